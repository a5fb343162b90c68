"""Host side of graph decode and packed prefill, on CPU: the ladder, bucket choice, the static
decode inputs and their padding, padded decode end to end, and the packed prefill's layout
(with a CPU stand-in for varlen_attn)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from handoff.rollout.engine import Engine
from handoff.rollout.graphs import DecodeInputs, bucket, graph_batch_sizes
from handoff.rollout.sampling import SamplingBatch, SamplingParams

GREEDY = SamplingParams(temperature=0.0, n=2, max_tokens=12)


def test_ladder_covers_every_batch_with_the_smallest_bucket():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192,
                                      224, 256]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]
    for max_num_seqs in (1, 3, 16, 50, 100, 129, 300):
        sizes = graph_batch_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
        for n in range(1, max_num_seqs + 1):
            b = bucket(n, sizes)
            assert b >= n and all(s < n for s in sizes if s < b)
        assert bucket(max_num_seqs + 1, sizes) is None


def _fill(inputs, tables, rows, lens, padded):
    return inputs.fill(np.array(rows), np.array(lens), tables, padded)


def test_decode_inputs_stage_rows_and_pad_to_the_bucket():
    rng = np.random.default_rng(0)
    bs, max_rows, max_blocks = 4, 8, 6
    tables = rng.integers(1, 100, (max_rows, max_blocks)).astype(np.int32)
    inputs = DecodeInputs(max_rows, max_blocks, bs, torch.device("cpu"), longest_first=True)
    rows, lens = [5, 0, 3], [9, 1, 17]
    width = _fill(inputs, tables, rows, lens, padded=8)
    assert width == 5  # 17 tokens in blocks of 4
    staged_rows, pos, tab, ctx, slots, order = inputs.views(8, width)
    # Attention starts the longest row first, padding (context 0) last, ties in row order.
    assert order.dtype == torch.int32 and order.tolist() == [2, 0, 1, 3, 4, 5, 6, 7]
    # Padding rows name the spare token row (max_rows), which only padding rows read.
    assert staged_rows.tolist() == rows + [max_rows] * 5 and pos.tolist() == [8, 0, 16] + [0] * 5
    assert ctx.dtype == torch.int32 and ctx.tolist() == lens + [0] * 5
    assert slots.tolist()[3:] == [-1] * 5  # padding is stored into the null block
    for i, (row, n) in enumerate(zip(rows, lens)):
        block, offset = divmod(slots[i].item(), bs)
        assert block == tables[row, (n - 1) // bs] and offset == (n - 1) % bs
        assert tab[i, :-(-n // bs)].tolist() == tables[row, :-(-n // bs)].tolist()
    assert tab.shape == (8, width) and tab.stride(0) == max_blocks
    # A smaller next step overwrites the rows that were real before with padding.
    _fill(inputs, tables, [2], [4], padded=2)
    staged_rows, pos, _, ctx, slots, order = inputs.views(4, 1)
    assert staged_rows.tolist()[:2] == [2, max_rows] and ctx.tolist()[:2] == [4, 0]
    assert order.tolist()[:2] == [0, 1]
    assert slots.tolist()[:2] == [tables[2, 0] * bs + 3, -1] and pos.tolist()[:2] == [3, 0]
    with pytest.raises(AssertionError):
        _fill(inputs, tables, [0, 1], [1, 1], padded=1)
    # Without longest_first nothing is ordered: attention starts the rows in row order.
    plain = DecodeInputs(max_rows, max_blocks, bs, torch.device("cpu"))
    _fill(plain, tables, rows, lens, padded=8)
    assert plain.views(8, width)[-1] is None


def test_sampling_inputs_are_staged_with_greedy_padding():
    inputs = DecodeInputs(8, 2, 4, torch.device("cpu"))
    batch = SamplingBatch(temperature=np.array([0.7, 0.0, 1.0], np.float32),
                          top_p=np.array([0.9, 1.0, 0.5], np.float32),
                          top_k=np.array([0, 4, 0], np.int64), uniform=np.array([0.1, 0.2, 0.3]))
    inputs.fill_sampling(batch, padded_rows=4)
    assert inputs.sampler_rows(0, 4, "greedy") is None
    plain = inputs.sampler_rows(1, 4, "sample")
    assert plain.top_k_B is None and plain.top_p_B is None
    assert plain.temperature_B.tolist() == [0.0, 1.0, 0.0]  # the padding row draws greedily
    assert plain.uniform_B.dtype == torch.float64 and plain.uniform_B.tolist() == [0.2, 0.3, 0.0]
    cut = inputs.sampler_rows(0, 4, "truncate")
    assert cut.top_k_B.tolist() == [0, 4, 0, 0] and cut.top_p_B.tolist() == pytest.approx(
        [0.9, 1.0, 0.5, 1.0])


def _tokens_and_logprobs(outs):
    return ([s.token_ids for o in outs for s in o.outputs],
            torch.tensor([lp for o in outs for s in o.outputs for lp in s.logprobs]))


def test_padded_decode_matches_exact_batches_and_writes_only_the_null_block(qwen3_dir, ref):
    """The CUDA decode path pads to the ladder at the full table width; run it on CPU."""
    exact = Engine(str(qwen3_dir), ref.cfg())
    padded = Engine(str(qwen3_dir), ref.cfg())
    padded.runner.pad_decode = True
    padded.runner.sizes = graph_batch_sizes(padded.cfg.max_num_seqs)
    prompts = ref.mixed_prompts  # 5 prompts x 2 samples: 10 rows run as 16
    want_tokens, want_logprobs = _tokens_and_logprobs(exact.generate(prompts, GREEDY))
    got_tokens, got_logprobs = _tokens_and_logprobs(padded.generate(prompts, GREEDY))
    assert got_tokens == want_tokens
    assert torch.allclose(got_logprobs, want_logprobs, atol=1e-4, rtol=0)
    assert padded.runner.kv_storage[:, :, 0].abs().sum() > 0  # padded rows' K/V went there
    assert exact.runner.kv_storage[:, :, 0].abs().sum() == 0
    stats = padded.stats()
    assert stats["graph_captures"] == 0 and stats["graph_pool_bytes"] == 0
    assert 0 < stats["host_ms_per_step"] <= stats["decode_ms_per_step"]


class _CallGraphs:
    """CPU stand-in for DecodeGraphs: 'capture' keeps the steps, 'replay' calls them, so the
    runner's graph path (static buffers, two replays a step, the mode's sampler) runs on CPU."""

    def __init__(self, sizes):
        self.sizes, self.steps, self.replays = list(sizes), {}, []
        self.num_captures, self.pool_bytes, self.driver_bytes = 0, 0, 0

    def capture(self, steps, device):
        self.steps = dict(steps)
        self.num_captures = len(steps)

    def replay(self, batch, part="model"):
        self.replays.append((batch, part))
        self.steps[batch, part]()


@pytest.mark.parametrize("graph_sampling", [True, False])
def test_graph_path_with_the_sampler_captured_matches_exact_batches(qwen3_dir, ref, monkeypatch,
                                                                    graph_sampling):
    import handoff.rollout.runner as runner_module

    monkeypatch.setattr(runner_module, "DecodeGraphs", _CallGraphs)
    exact = Engine(str(qwen3_dir), ref.cfg())
    graphs = Engine(str(qwen3_dir), ref.cfg())
    runner = graphs.runner
    runner.pad_decode = runner.use_graphs = True
    runner.sample_in_graph = graph_sampling
    runner.decode_gemm = "cublas"   # a named library: nothing to time on a CPU
    runner.sizes = graph_batch_sizes(graphs.cfg.max_num_seqs)
    runner.bind_tables(graphs.blocks.tables)
    assert runner.gemm_by_size == dict.fromkeys(runner.sizes, "cublas")
    parts = 4 if graph_sampling else 1  # the model, and the sampler in each of its 3 modes
    assert runner.graphs.num_captures == parts * len(runner.sizes)
    prompts = ref.mixed_prompts  # 5 prompts x 2 samples: 10 rows run as 16
    for mode, params in (("greedy", GREEDY),
                         ("sample", SamplingParams(temperature=0.9, n=2, seed=3, max_tokens=12)),
                         ("truncate", SamplingParams(temperature=1.0, top_p=0.8, top_k=20, n=2,
                                                     seed=4, max_tokens=12))):
        runner.graphs.replays.clear()
        want_tokens, want_logprobs = _tokens_and_logprobs(exact.generate(prompts, params))
        got_tokens, got_logprobs = _tokens_and_logprobs(graphs.generate(prompts, params))
        assert got_tokens == want_tokens
        assert torch.allclose(got_logprobs, want_logprobs, atol=1e-4, rtol=0)
        # Every decode step replays the model, then (graph_sampling) its mode's sampler.
        want = [(16, "model"), (16, mode)] if graph_sampling else [(16, "model")]
        assert runner.graphs.replays[:len(want)] == want
        assert {part for _, part in runner.graphs.replays} == {part for _, part in want}
    assert graphs.stats()["graph_sampling"] is graph_sampling


def _varlen_on_cpu(q_THD, k_LKD, v_LKD, cu_q, cu_k, max_q, max_k, *, scale):
    """What varlen_attn computes (bottom-right causal per sequence), with SDPA on CPU."""
    from handoff.rollout.attention import _causal_attention

    out_THD = torch.empty_like(q_THD)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(cq, cq[1:]))
    assert max_k == max(b - a for a, b in zip(ck, ck[1:]))
    for i in range(len(cq) - 1):
        out_THD[cq[i]:cq[i + 1]] = _causal_attention(q_THD[cq[i]:cq[i + 1]],
                                                      k_LKD[ck[i]:ck[i + 1]],
                                                      v_LKD[ck[i]:ck[i + 1]], scale)
    return out_THD


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_packed_prefill_layout_matches_the_reference_loop(qwen3_dir, ref, monkeypatch, kv_dtype):
    """Key slots, cu_seqlens and the fresh-prompt shortcut, with prefix hits, vs the loop."""
    import handoff.rollout.kernels.prefill as prefill

    loop = Engine(str(qwen3_dir), ref.cfg(kv_dtype=kv_dtype))
    packed = Engine(str(qwen3_dir), ref.cfg(kv_dtype=kv_dtype))
    packed.runner.packed_prefill = True
    calls = []

    def fake(*args, **kwargs):
        calls.append(args[0].shape[0])
        return _varlen_on_cpu(*args, **kwargs)

    monkeypatch.setattr(prefill, "varlen_attention", fake)
    prefix = list(range(60, 80))
    fresh = SamplingParams(temperature=0.0, max_tokens=12)
    rounds = [(ref.mixed_prompts, fresh),  # nothing cached: keys are the new tokens
              (ref.mixed_prompts + [prefix + [1, 2], prefix + [3]], GREEDY)]  # prefix hits
    for prompts, params in rounds:
        want_tokens, want_logprobs = _tokens_and_logprobs(loop.generate(prompts, params))
        got_tokens, got_logprobs = _tokens_and_logprobs(packed.generate(prompts, params))
        assert got_tokens == want_tokens
        assert torch.allclose(got_logprobs, want_logprobs, atol=1e-4, rtol=0)
    assert packed.stats()["prefix_cache_hits"] > 0
    assert len(calls) == packed.stats()["prefill_steps"] * packed.spec.num_layers


def test_varlen_self_check_rejects_a_misaligned_mask(monkeypatch):
    """The start-up check that guards the packed prefill, with CPU stand-ins for varlen_attn."""
    import handoff.rollout.kernels.prefill as prefill
    from handoff.rollout.attention import _varlen_agrees

    check = _varlen_agrees.__wrapped__  # uncached
    monkeypatch.setattr(prefill, "varlen_attention", _varlen_on_cpu)
    assert check(torch.device("cpu"), torch.float32)

    def top_left(q_THD, k_LKD, v_LKD, cu_q, cu_k, max_q, max_k, *, scale):
        # Query i sees keys 0..i (FlashAttention 1's alignment): wrong when keys > queries.
        from handoff.rollout.attention import _causal_attention

        out_THD = torch.empty_like(q_THD)
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            keys = slice(ck[i], ck[i] + cq[i + 1] - cq[i])
            out_THD[cq[i]:cq[i + 1]] = _causal_attention(q_THD[cq[i]:cq[i + 1]], k_LKD[keys],
                                                          v_LKD[keys], scale)
        return out_THD

    monkeypatch.setattr(prefill, "varlen_attention", top_left)
    with pytest.warns(UserWarning, match="falls back"):
        assert not check(torch.device("cpu"), torch.float32)

    def broken(*args, **kwargs):
        raise TypeError("unexpected keyword 'window_size'")

    monkeypatch.setattr(prefill, "varlen_attention", broken)
    with pytest.warns(UserWarning, match="TypeError"):
        assert not check(torch.device("cpu"), torch.float32)
