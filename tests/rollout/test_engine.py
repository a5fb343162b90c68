"""Engine vs transformers on CPU (fp32, tiny checkpoints): greedy tokens and log-probs.

Covers the acceptance list of the engine issue: mixed prompt lengths, shared prefixes, n > 1,
preemption forced by a tiny pool, sleep(2) + wake + load_weights, and sampled-token log-probs
within 1e-4 of a transformers forward.
"""

from __future__ import annotations

import pytest
import torch

from handoff.errors import HandoffError
from handoff.rollout.engine import Engine
from handoff.rollout.models import iter_checkpoint
from handoff.rollout.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _tokens(outs) -> list[list[int]]:
    return [s.token_ids for o in outs for s in o.outputs]


@pytest.mark.parametrize("which", ["qwen3_dir", "llama_dir"])
def test_greedy_mixed_lengths_match_transformers(which, ref, request):
    path = request.getfixturevalue(which)
    engine = Engine(str(path), ref.cfg())
    outs = engine.generate(ref.mixed_prompts, GREEDY)
    for prompt, out in zip(ref.mixed_prompts, outs):
        (sample,) = out.outputs
        assert sample.token_ids == ref.greedy(path, prompt, 24)
        assert len(set(sample.token_ids)) > 3, "degenerate model: the test would prove nothing"
        expected = ref.logprobs(path, prompt, sample.token_ids)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
        assert sample.finish_reason in ("stop", "length")
    assert engine.stats()["decode_steps"] > 0


def test_shared_prefix_and_n_samples(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg())
    prefix = list(range(50, 70))  # five full blocks of 4
    prompts = [prefix + [1, 2], prefix + [3], prefix + [4, 5, 6, 7, 8]]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, n=3, max_tokens=16))
    first_hits = engine.stats()["prefix_cache_hits"]
    assert first_hits >= 8 * 20  # 8 of the 9 sequences reuse the 20-token prefix
    for prompt, out in zip(prompts, outs):
        expected = ref.greedy(qwen3_dir, prompt, 16)
        assert [s.token_ids for s in out.outputs] == [expected] * 3
    again = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert _tokens(again) == [out.outputs[0].token_ids for out in outs]
    assert engine.stats()["prefix_cache_hits"] > first_hits  # freed blocks were revived


def test_preemption_with_tiny_pool(llama_dir, ref):
    cfg = ref.cfg(num_blocks=20, max_model_len=64)  # 16 blocks hold one full-length sequence
    engine = Engine(str(llama_dir), cfg)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = engine.generate(ref.mixed_prompts[:4], params)
    stats = engine.stats()
    assert stats["preemptions"] > 0
    for prompt, out in zip(ref.mixed_prompts[:4], outs):
        expected = ref.greedy(llama_dir, prompt, 40)
        n = len(out.outputs[0].token_ids)
        assert out.outputs[0].token_ids == expected[:n]
        assert n == min(40, 64 - len(prompt)) or out.outputs[0].finish_reason == "stop"
    assert stats["free_blocks"] == 19  # everything returned (block 0 is the null block)


def test_sleep2_wake_reload_same_weights(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg())
    before = _tokens(engine.generate(ref.mixed_prompts, GREEDY))
    version = engine.weights_version
    engine.sleep(2)
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    assert engine.runner.kv_storage.untyped_storage().nbytes() == 0
    assert engine.model.rope_cos_sin.untyped_storage().nbytes() == 0
    with pytest.raises(HandoffError, match="asleep"):
        engine.generate(ref.mixed_prompts, GREEDY)
    engine.wake_up()
    with pytest.raises(HandoffError, match="load_weights"):
        engine.generate(ref.mixed_prompts, GREEDY)
    tensors = list(iter_checkpoint(qwen3_dir))
    engine.load_weights(tensors[:5])  # a sync arrives in buckets: one version for all
    with pytest.raises(HandoffError, match="missing"):
        engine.generate(ref.mixed_prompts, GREEDY)
    engine.load_weights(tensors[5:])
    assert engine.weights_version == version + 1
    assert not engine.runner.kv_storage.any()  # the woken pool starts zeroed
    after = engine.generate(ref.mixed_prompts, GREEDY)
    assert _tokens(after) == before
    engine.load_weights(tensors)
    assert engine.weights_version == version + 2
    for name, tensor in tensors:
        assert torch.equal(engine.export_weight(name), tensor)
    assert after[1].outputs[0].token_ids == ref.greedy(qwen3_dir, ref.mixed_prompts[1], 24)


def test_sleep1_keeps_weights_and_tags_wake_separately(llama_dir, ref):
    engine = Engine(str(llama_dir), ref.cfg())
    before = _tokens(engine.generate(ref.mixed_prompts, GREEDY))
    engine.sleep(1)
    assert engine.runner.kv_storage.untyped_storage().nbytes() == 0
    engine.wake_up(["weights"])
    assert engine.stats()["awake"] == {"weights": True, "kv_cache": False}
    with pytest.raises(HandoffError, match="asleep"):
        engine.generate(ref.mixed_prompts, GREEDY)
    engine.wake_up(["kv_cache"])
    assert _tokens(engine.generate(ref.mixed_prompts, GREEDY)) == before
    engine.sleep(0)
    with pytest.raises(HandoffError, match="paused=True"):
        engine.generate(ref.mixed_prompts, GREEDY)
    engine.wake_up()
    assert _tokens(engine.generate(ref.mixed_prompts, GREEDY)) == before


def test_load_new_weights_equals_fresh_engine(qwen3_dir, ref, tmp_path):
    other = ref.write_checkpoint("tiny-qwen3", tmp_path / "other", seed=2)
    engine = Engine(str(qwen3_dir), ref.cfg())
    old = _tokens(engine.generate(ref.mixed_prompts, GREEDY))
    engine.sleep(2)
    engine.wake_up(["weights"])
    engine.load_weights(iter_checkpoint(other))
    engine.wake_up(["kv_cache"])
    new = _tokens(engine.generate(ref.mixed_prompts, GREEDY))
    assert new != old
    assert new == _tokens(Engine(str(other), ref.cfg()).generate(ref.mixed_prompts, GREEDY))


def test_sampled_logprobs_match_transformers(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg())
    prompt = ref.mixed_prompts[1]
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, seed=3, n=2, max_tokens=20)
        for sample in engine.generate([prompt], params)[0].outputs:
            expected = ref.logprobs(qwen3_dir, prompt, sample.token_ids, temperature)
            assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


def test_top_k_restricts_support(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg())
    prompt = ref.mixed_prompts[0]
    params = SamplingParams(temperature=1.5, top_k=3, seed=11, n=4, max_tokens=12)
    samples = engine.generate([prompt], params)[0].outputs
    for sample in samples:
        logits = ref.logits(qwen3_dir, prompt + sample.token_ids)[len(prompt) - 1:-1]
        top3 = logits.topk(3, dim=-1).indices
        assert (top3 == torch.tensor(sample.token_ids)[:, None]).any(dim=-1).all()
    assert len({tuple(s.token_ids) for s in samples}) > 1  # it did sample


def test_seeded_sampling_ignores_batch_composition(llama_dir, ref):
    engine = Engine(str(llama_dir), ref.cfg())
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5, n=2, max_tokens=16)
    alone = engine.generate([ref.mixed_prompts[2]], params)[0]
    others = SamplingParams(temperature=0.8, seed=9, n=3, max_tokens=20)
    mixed = engine.generate(ref.mixed_prompts, [others, others, params, others, others])[2]
    assert [s.token_ids for s in mixed.outputs] == [s.token_ids for s in alone.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # samples differ
    reseeded = engine.generate([ref.mixed_prompts[2]], SamplingParams(
        temperature=1.0, top_p=0.9, seed=6, n=2, max_tokens=16))[0]
    assert reseeded.outputs[0].token_ids != alone.outputs[0].token_ids


def test_stop_ids_and_length_limits(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg(max_model_len=32))
    prompt = ref.mixed_prompts[3]  # 13 tokens
    greedy = ref.greedy(qwen3_dir, prompt, 6)
    stop = greedy[3]
    cut = greedy.index(stop)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                                                   stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == greedy[:cut + 1] and out.finish_reason == "stop"
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=100,
                                                   ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 32 - 13 and out.finish_reason == "length"


def test_each_sample_ends_at_its_own_length(qwen3_dir, ref):
    """sample_max_tokens (benchmark workloads): every sample of a prompt stops at its own
    length, the shared prefix and the greedy tokens unchanged; lengths that do not match n
    are refused."""
    engine = Engine(str(qwen3_dir), ref.cfg(max_model_len=64))
    prompt = ref.mixed_prompts[3]
    greedy = ref.greedy(qwen3_dir, prompt, 9)
    lengths = (3, 9, 1)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, n=3, ignore_eos=True,
                                                   max_tokens=9, sample_max_tokens=lengths))[0]
    assert [len(o.token_ids) for o in out.outputs] == list(lengths)
    assert all(o.token_ids == greedy[:len(o.token_ids)] for o in out.outputs)
    assert engine.stats()["peak_running"] == 3
    with pytest.raises(HandoffError, match="n=2 lengths"):
        SamplingParams(n=2, sample_max_tokens=(4,))


def test_steps_staged_ahead_drop_tokens_of_stopped_sequences(qwen3_dir, ref):
    """Decode steps are launched before the previous step's tokens are known: a sequence
    that stops in step n is in step n+1 too, and that token must vanish without a trace
    (outputs, counters, blocks), while the others go on as if each ran alone."""
    engine = Engine(str(qwen3_dir), ref.cfg())
    prompts = ref.mixed_prompts[:4]
    full = [ref.greedy(qwen3_dir, p, 12) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[f[k]])
              for f, k in zip(full, (2, 5, 8, 11))]
    before = engine.stats()
    outs = engine.generate(prompts, params)
    after = engine.stats()
    for f, p, out in zip(full, params, outs):
        cut = f.index(p.stop_token_ids[0])
        assert out.outputs[0].token_ids == f[:cut + 1]
        assert out.outputs[0].finish_reason == "stop"
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert after["generated_tokens"] - before["generated_tokens"] == generated
    assert after["decode_steps_staged"] > before["decode_steps_staged"]  # it did stage
    assert after["free_blocks"] == engine.blocks.num_blocks - 1  # nothing leaked
    # Blocks filled by decode steps were hashed once stored (at postprocess): a prompt that
    # continues the last sequence's text finds every full block of it, and the cached KV
    # gives the same tokens as before.
    last = prompts[3] + outs[3].outputs[0].token_ids[:9]
    hits = engine.stats()["prefix_cache_hits"]
    cont = engine.generate([last], SamplingParams(temperature=0.0, max_tokens=3,
                                                  ignore_eos=True))[0].outputs[0]
    bs = engine.blocks.block_size
    assert engine.stats()["prefix_cache_hits"] - hits == (len(last) - 1) // bs * bs
    assert cont.token_ids == ref.greedy(qwen3_dir, last, 3)


def test_fp8_kv_cache_runs_and_resets_on_wake(qwen3_dir, ref):
    exact = Engine(str(qwen3_dir), ref.cfg())
    fp8 = Engine(str(qwen3_dir), ref.cfg(kv_dtype="fp8"))
    assert fp8.runner.kv_storage.dtype == torch.float8_e4m3fn
    assert fp8.stats()["kv_cache_bytes"] * 4 == exact.stats()["kv_cache_bytes"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    a = exact.generate(ref.mixed_prompts, params)
    b = fp8.generate(ref.mixed_prompts, params)
    # e4m3 keeps ~2 significant digits: the first token's log-prob moves only a little.
    for x, y in zip(a, b):
        assert abs(x.outputs[0].logprobs[0] - y.outputs[0].logprobs[0]) < 0.1
    assert fp8.runner.kv_storage.float().abs().sum() > 0
    fp8.runner.kv_scales.fill_(3.0)
    fp8.sleep(1)
    fp8.wake_up()
    assert not fp8.runner.kv_storage.float().any()
    assert torch.equal(fp8.runner.kv_scales, torch.ones_like(fp8.runner.kv_scales))


def test_user_errors_name_the_fix(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg(max_model_len=16))
    with pytest.raises(HandoffError, match="max_model_len"):
        engine.generate([list(range(20))], GREEDY)
    with pytest.raises(HandoffError, match="empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(HandoffError, match="outside"):
        engine.generate([[1, 999]], GREEDY)
    with pytest.raises(HandoffError, match="one per prompt"):
        engine.generate([[1], [2]], [GREEDY])
    with pytest.raises(HandoffError, match="unknown engine tags"):
        engine.wake_up(["kv"])
    with pytest.raises(HandoffError, match="cannot hold one sequence"):
        Engine(str(qwen3_dir), ref.cfg(num_blocks=3))
    with pytest.raises(HandoffError, match="no place"):
        engine.load_weights([("model.layers.0.self_attn.x_proj.weight", torch.zeros(1))])


def test_profiling_forward_without_cache_equals_the_paged_prefill(qwen3_dir, ref):
    """The cache-less forward that sizes the CUDA pool computes the same prefill."""
    from handoff.rollout.attention import AttnMeta
    from handoff.rollout.sequence import Sequence

    engine = Engine(str(qwen3_dir), ref.cfg())
    prompts = ref.mixed_prompts[:3]
    seqs = [Sequence(i, p, GREEDY, request_index=i, sample_index=0, key=0, stop_ids=frozenset())
            for i, p in enumerate(prompts)]
    for seq in seqs:
        assert engine.blocks.allocate(seq)
    with torch.inference_mode():
        paged, _ = engine.runner._prefill(seqs)
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.cat([torch.arange(len(p)) for p in prompts])
        meta = AttnMeta(is_prefill=True, kv=None, query_lens=[len(p) for p in prompts])
        hidden = engine.model(ids, positions, meta)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        fresh = engine.model.compute_logits(hidden[ends])
    assert torch.allclose(paged, fresh, atol=1e-5)
    for seq in seqs:
        engine.blocks.free_seq(seq)


def test_the_decode_counts_what_it_reads_at_the_least(qwen3_dir, ref):
    """decode_read_bytes: the weights once a decode step, every running sequence's K/V once
    (its prompt and what it generated so far): the bench's HBM floor, counted by the engine."""
    engine = Engine(str(qwen3_dir), ref.cfg())
    prompts, lengths = [[1, 2, 3], [4, 5, 6, 7, 8], [9]], [4, 2, 6]
    before = engine.stats()
    engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                              for n in lengths])
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps == max(lengths) - 1   # the first token of each comes from its prefill
    kv_token = after["kv_block_bytes"] // after["block_size"]
    read = after["decode_read_bytes"] - before["decode_read_bytes"]
    # decode step j of a sequence of prompt P reads P + j tokens, j = 1 .. its length - 1:
    # 4 + 5 + 6, then 6, then 2 + 3 + 4 + 5 + 6 = 41 tokens over 5 steps
    assert read == 5 * engine.decode_weight_bytes + 41 * kv_token
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert 0 < engine.decode_weight_bytes <= params


def test_longest_first_stages_an_order_and_changes_no_token(qwen3_dir, ref, monkeypatch):
    """By default each decode step stages its rows longest context first for the attention
    kernel (an order of launch, not of results); HANDOFF_LONGEST_FIRST=0 stages none."""
    prompts = [[1, 2, 3], list(range(10, 30)), [9]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    monkeypatch.setenv("HANDOFF_LONGEST_FIRST", "0")
    engine = Engine(str(qwen3_dir), ref.cfg())
    unordered = []
    decode = engine.runner.decode_fn
    engine.runner.decode_fn = lambda *a, order=None, **kw: (unordered.append(order)
                                                            or decode(*a, order=order, **kw))
    plain = engine.generate(prompts, params)
    assert unordered and all(o is None for o in unordered)
    monkeypatch.delenv("HANDOFF_LONGEST_FIRST")
    engine = Engine(str(qwen3_dir), ref.cfg())
    seen = []
    decode = engine.runner.decode_fn
    engine.runner.decode_fn = lambda *a, order=None, **kw: (seen.append(order.tolist())
                                                            or decode(*a, order=order, **kw))
    ordered = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ordered] == [o.outputs[0].token_ids for o in plain]
    assert seen and seen[0][:3] == [1, 0, 2]   # 21, 4 and 2 tokens of context


def test_a_decode_step_asks_each_layer_for_its_prefetch_and_joins_it(qwen3_dir, ref,
                                                                      monkeypatch):
    """With an L2 prefetch (kernels/prefetch.LayerPrefetch; CUDA sm_90 only, so a recorder
    stands in here), every layer of a decode step at <= PREFETCH_MAX_ROWS rows asks once its
    qkv product is launched and joins before it ends, in layer order; prefill asks nothing;
    the tokens are the ones without it. HANDOFF_L2_PREFETCH unset: none on any device; a bad
    plan: one line naming the fix, on any device."""
    from handoff.rollout.runner import PREFETCH_MAX_ROWS

    monkeypatch.setenv("HANDOFF_L2_PREFETCH", "o+gu")
    with pytest.raises(HandoffError, match="gu<MB>"):   # named on any device
        Engine(str(qwen3_dir), ref.cfg())
    monkeypatch.delenv("HANDOFF_L2_PREFETCH")
    prompts = [[1, 2, 3], list(range(10, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = Engine(str(qwen3_dir), ref.cfg())
    assert engine.runner.prefetch is None
    plain = engine.generate(prompts, params)

    class Recorder:
        def __init__(self):
            self.calls = []

        def after_qkv(self, layer):
            self.calls.append(("ask", layer))

        def join(self):
            self.calls.append(("join",))

    engine = Engine(str(qwen3_dir), ref.cfg())
    engine.runner.prefetch = recorder = Recorder()
    asked = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in asked] == [o.outputs[0].token_ids for o in plain]
    layers = engine.model.spec.num_layers
    one_step = [c for i in range(layers) for c in (("ask", i), ("join",))]
    assert len(prompts) <= PREFETCH_MAX_ROWS
    assert recorder.calls == one_step * 3   # 4 tokens: one from the prefill, 3 decode steps
