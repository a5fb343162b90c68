"""CUDA-graph decode and packed prefill on a GPU: graphs equal eager, never recaptured across
sleep/wake, their pool reported and reserved, fp8 KV with graphs, varlen prefill vs the loop.

Run on the device: python3 -m pytest -q -m cuda tests/rollout/test_graphs_cuda.py
Graphs off and on run the same padded shapes through the same kernels, so their greedy
tokens must be identical, not merely close. Every engine sleeps at the end (its regions'
memory would otherwise stay mapped for the rest of the process).
"""

from __future__ import annotations

import pytest
import torch

from handoff.rollout.engine import Engine
from handoff.rollout.graphs import graph_batch_sizes
from handoff.rollout.models import iter_checkpoint
from handoff.rollout.sampling import SamplingParams
from handoff.rollout.sequence import Sequence

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _cfg(ref, **kw):
    return ref.cfg(**{"num_blocks": 1024, "block_size": 16, "max_num_seqs": 64, **kw})


def _prompts(num: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(3 + (5 * i) % 40)] for i in range(num)]


def _outputs(outs):
    tokens = [s.token_ids for o in outs for s in o.outputs]
    return tokens, torch.tensor([lp for o in outs for s in o.outputs for lp in s.logprobs])


def test_graph_decode_equals_eager(qwen3_dir, ref):
    eager = Engine(str(qwen3_dir), _cfg(ref, cuda_graphs=False), dtype="bfloat16")
    graph = Engine(str(qwen3_dir), _cfg(ref), dtype="bfloat16")
    stats = graph.stats()
    # Per ladder size: the model, and the LM head with the sampler in each of its 3 modes.
    assert stats["graph_captures"] == 4 * len(graph_batch_sizes(64)) == \
        4 * len(stats["graph_batch_sizes"]) and stats["graph_sampling"]
    assert stats["graph_pool_bytes"] > 0 and eager.stats()["graph_captures"] == 0
    prompts = _prompts(19)
    # n=2 with different lengths: 38 rows (bucket 48) shrinking through 32, 16, 8, ... as
    # sequences finish; sampled rows too, with prefix hits from the shared prompts.
    for params in ([SamplingParams(temperature=0.0, n=2, max_tokens=4 + 3 * i) for i in range(19)],
                   [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=20)
                    for i in range(19)]):
        want_tokens, want_logprobs = _outputs(eager.generate(prompts, params))
        got_tokens, got_logprobs = _outputs(graph.generate(prompts, params))
        assert got_tokens == want_tokens
        assert torch.allclose(got_logprobs, want_logprobs, atol=1e-5, rtol=0)
    stats = graph.stats()
    assert 0 < stats["host_ms_per_step"] < stats["decode_ms_per_step"]
    print(f"\ngraphs {stats['graph_batch_sizes']}: pool {stats['graph_pool_bytes'] / 2**20:.1f} "
          f"MiB (driver {stats['graph_driver_bytes'] / 2**20:.1f} MiB); decode "
          f"{stats['decode_ms_per_step']:.3f} ms/step, host {stats['host_ms_per_step']:.3f} ms; "
          f"eager {eager.stats()['decode_ms_per_step']:.3f} ms/step")
    eager.sleep(2)
    graph.sleep(2)


def test_the_sampler_in_the_graphs_draws_what_it_draws_outside(qwen3_dir, ref):
    """rollout.graph_sampling on and off: the same tokens and log-probs, bit for bit (the same
    ops on the same padded rows), greedy, sampled and truncated."""
    engines = {on: Engine(str(qwen3_dir), _cfg(ref, graph_sampling=on), dtype="bfloat16")
               for on in (True, False)}
    assert engines[False].stats()["graph_captures"] == len(graph_batch_sizes(64))
    prompts = _prompts(21)
    for params in (SamplingParams(temperature=0.0, n=2, max_tokens=16),
                   SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=16),
                   SamplingParams(temperature=1.0, top_p=0.9, top_k=40, n=2, seed=2,
                                  max_tokens=16)):
        want = _outputs(engines[False].generate(prompts, params))
        got = _outputs(engines[True].generate(prompts, params))
        assert got[0] == want[0] and torch.equal(got[1], want[1])
    stats = {on: e.stats() for on, e in engines.items()}
    print(f"\nhost ms/step, sampler in / outside the graphs: {stats[True]['host_ms_per_step']:.3f}"
          f" / {stats[False]['host_ms_per_step']:.3f}; graph pool "
          f"{stats[True]['graph_pool_bytes'] / 2**20:.1f} / "
          f"{stats[False]['graph_pool_bytes'] / 2**20:.1f} MiB")
    for engine in engines.values():
        engine.sleep(2)


@pytest.mark.parametrize("mode", ["greedy", "sample", "truncate"])
def test_the_sampler_captured_at_a_real_vocabulary_equals_eager(mode):
    """Qwen3's 151,936 tokens: the sort, cumsum and search of a full-size vocabulary (the tiny
    test model's 320 take other kernels) captured and replayed equal the eager draw."""
    from handoff.rollout.graphs import DecodeGraphs
    from handoff.rollout.sampling import SamplerRows, draw

    dev, rows, vocab = torch.device("cuda"), 48, 151_936
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(rows, vocab, device=dev, generator=gen, dtype=torch.bfloat16) * 4
    inputs = SamplerRows(
        temperature_B=torch.rand(rows, device=dev, generator=gen) + 0.3,
        uniform_B=torch.rand(rows, device=dev, generator=gen, dtype=torch.float64),
        top_k_B=torch.randint(0, 50, (rows,), device=dev, generator=gen),
        top_p_B=torch.rand(rows, device=dev, generator=gen) * 0.5 + 0.5)
    inputs.temperature_B[::7] = 0.0   # greedy rows among sampled ones
    staged = None if mode == "greedy" else inputs
    tokens, logprobs = torch.zeros(rows, dtype=torch.int64, device=dev), torch.zeros(rows, device=dev)

    def drawn():   # what the runner's _sample_step does, 32 rows at a time
        out = [draw(logits[lo:lo + 32], None if staged is None else SamplerRows(
            *(t[lo:lo + 32] for t in (staged.temperature_B, staged.uniform_B, staged.top_k_B,
                                      staged.top_p_B))), truncate=mode == "truncate")
               for lo in range(0, rows, 32)]
        return torch.cat([t for t, _ in out]), torch.cat([lp for _, lp in out])

    def step():
        t, lp = drawn()
        tokens.copy_(t)
        logprobs.copy_(lp)

    graphs = DecodeGraphs([rows])
    graphs.capture({(rows, mode): step}, dev)
    for _ in range(2):   # new logits and uniforms in the same buffers: the replay follows them
        logits.copy_(torch.randn(rows, vocab, device=dev, generator=gen, dtype=torch.bfloat16) * 4)
        inputs.uniform_B.copy_(torch.rand(rows, device=dev, generator=gen, dtype=torch.float64))
        want = drawn()
        graphs.replay(rows, mode)
        torch.cuda.synchronize()
        assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])


def test_decode_gemm_auto_times_each_backend_and_a_named_one_equals_eager(qwen3_dir, ref):
    from handoff.rollout.gemm_choice import backends_for

    auto = Engine(str(qwen3_dir), _cfg(ref, decode_gemm="auto"), dtype="bfloat16")
    stats = auto.stats()
    sizes = stats["graph_batch_sizes"]
    assert sorted(stats["decode_gemm"]) == sizes
    for b in sizes:
        ms = stats["decode_gemm_ms"][b]
        assert set(ms) == set(backends_for(b)) and all(t > 0 for t in ms.values())
        assert stats["decode_gemm"][b] in ms
    print("\ndecode GEMM backend per batch (ms each): " + ", ".join(
        f"{b}: {stats['decode_gemm'][b]} ("
        + " / ".join(f"{k} {v:.3f}" for k, v in stats['decode_gemm_ms'][b].items()) + ")"
        for b in sizes))
    prompts = _prompts(19)
    params = SamplingParams(temperature=0.0, n=2, max_tokens=16)
    assert len(auto.generate(prompts, params)) == len(prompts)
    auto.sleep(2)
    for backend in ("cublaslt", "triton"):
        named = {graphs: Engine(str(qwen3_dir), _cfg(ref, decode_gemm=backend,
                                                     cuda_graphs=graphs), dtype="bfloat16")
                 for graphs in (True, False)}
        want, got = (_outputs(named[g].generate(prompts, params)) for g in (False, True))
        assert got[0] == want[0] and torch.equal(got[1], want[1]), backend
        assert named[True].stats()["decode_gemm"] == dict.fromkeys(sizes, backend)
        for engine in named.values():
            engine.sleep(2)


def test_graph_pool_is_reserved_before_the_kv_pool(qwen3_dir, ref):
    util = 0.1
    engine = Engine(str(qwen3_dir), _cfg(ref, num_blocks=None, gpu_memory_utilization=util,
                                         max_model_len=512), dtype="bfloat16")
    stats = engine.stats()
    assert 0 < stats["graph_pool_bytes"] <= stats["graph_reserve_bytes"]
    _, total = torch.cuda.mem_get_info()
    own = engine.pool.region_bytes("weights")
    budget = util * total - own - stats["activation_peak_bytes"] - stats["graph_reserve_bytes"]
    assert budget - stats["kv_block_bytes"] < stats["kv_cache_bytes"] <= budget
    print(f"\ngraph pool {stats['graph_pool_bytes'] / 2**20:.1f} MiB measured, "
          f"{stats['graph_reserve_bytes'] / 2**20:.1f} MiB reserved")
    engine.sleep(2)


def test_no_recapture_across_sleep_wake_with_new_weights(qwen3_dir, ref, tmp_path):
    other = ref.write_checkpoint("tiny-qwen3", tmp_path / "other", seed=2)
    weights = {p: list(iter_checkpoint(p)) for p in (qwen3_dir, other)}
    cfg = _cfg(ref)
    prompts = ref.mixed_prompts
    expected = {}
    for path in (qwen3_dir, other):
        fresh = Engine(str(path), cfg, dtype="bfloat16")
        expected[path] = _outputs(fresh.generate(prompts, GREEDY))[0]
        fresh.sleep(2)
    assert expected[qwen3_dir] != expected[other]
    engine = Engine(str(qwen3_dir), cfg, dtype="bfloat16")
    before = engine.stats()
    graphs = dict(engine.runner.graphs.graphs)
    kv_ptr = engine.runner.kv_storage.data_ptr()
    for cycle in range(10):
        path = other if cycle % 2 == 0 else qwen3_dir
        engine.sleep(2)
        engine.wake_up(["weights"])
        engine.load_weights(weights[path])
        engine.wake_up(["kv_cache"])
        assert _outputs(engine.generate(prompts, GREEDY))[0] == expected[path], cycle
    after = engine.stats()
    assert after["graph_captures"] == before["graph_captures"] == len(graphs)
    assert after["graph_pool_bytes"] == before["graph_pool_bytes"]
    assert engine.runner.graphs.graphs == graphs and engine.runner.kv_storage.data_ptr() == kv_ptr
    assert after["weights_version"] == before["weights_version"] + 10
    engine.sleep(2)


def _first_logprobs(outs) -> torch.Tensor:
    return torch.tensor([s.logprobs[0] for o in outs for s in o.outputs])


def test_fp8_kv_with_graphs(qwen3_dir, ref):
    bf16 = Engine(str(qwen3_dir), _cfg(ref), dtype="bfloat16")
    fp8 = Engine(str(qwen3_dir), _cfg(ref, kv_dtype="fp8"), dtype="bfloat16")
    fp8_eager = Engine(str(qwen3_dir), _cfg(ref, kv_dtype="fp8", cuda_graphs=False),
                       dtype="bfloat16")
    assert fp8.stats()["graph_captures"] > 0 and fp8.stats()["kv_dtype"] == "float8_e4m3fn"
    params = SamplingParams(temperature=0.0, n=2, max_tokens=16)
    prompts = ref.mixed_prompts
    want = bf16.generate(prompts, params)
    got = fp8.generate(prompts, params)
    assert _outputs(fp8_eager.generate(prompts, params))[0] == _outputs(got)[0]
    assert (_first_logprobs(got) - _first_logprobs(want)).abs().max() < 0.15
    fp8.runner.kv_scales.fill_(3.0)  # must be reset, in place, where the graphs read it
    fp8.sleep(2)
    fp8.wake_up(["weights"])
    fp8.load_weights(iter_checkpoint(qwen3_dir))
    fp8.wake_up(["kv_cache"])
    assert not fp8.runner.kv_storage.view(torch.uint8).any()
    assert torch.equal(fp8.runner.kv_scales, torch.ones_like(fp8.runner.kv_scales))
    assert _outputs(fp8.generate(prompts, params))[0] == _outputs(got)[0]
    for engine in (bf16, fp8, fp8_eager):
        engine.sleep(2)


def test_graphs_need_the_triton_backend(qwen3_dir, ref):
    with pytest.warns(UserWarning, match="cuda_graphs is ignored"):
        engine = Engine(str(qwen3_dir), _cfg(ref), dtype="bfloat16", attention_backend="torch")
    assert engine.stats()["graph_captures"] == 0
    assert engine.generate(ref.mixed_prompts[:2], GREEDY)[0].outputs[0].token_ids
    engine.sleep(2)


@torch.inference_mode()
def test_packed_prefill_matches_the_loop_with_prefix_hits(qwen3_dir, ref):
    packed = Engine(str(qwen3_dir), _cfg(ref), dtype="bfloat16")
    loop = Engine(str(qwen3_dir), _cfg(ref), dtype="bfloat16")
    loop.runner.packed_prefill = False
    assert packed.runner.packed_prefill and packed.stats()["packed_prefill"]
    prefix = list(range(30, 130))  # 6 full blocks of 16, then a partial one
    prompts = [prefix + [1, 2, 3], prefix[:40] + [9] * 50, list(range(200, 233)), prefix]
    logits = []
    for engine in (packed, loop):
        engine.generate([prefix + [5]], SamplingParams(temperature=0.0, max_tokens=1))
        seqs = [Sequence(i, p, GREEDY, request_index=i, sample_index=0, key=0,
                         stop_ids=frozenset()) for i, p in enumerate(prompts)]
        for seq in seqs:
            assert engine.blocks.allocate(seq)
        assert [s.num_cached_tokens for s in seqs] == [96, 32, 0, 96]
        logits.append(engine.runner._prefill(seqs)[0].float().log_softmax(-1))
        for seq in seqs:
            engine.blocks.free_seq(seq)
        engine.sleep(2)
    assert (logits[0] - logits[1]).abs().max() < 0.05
