"""The engine on a CUDA device: bf16 equivalence, memory really handed back, weight swaps.

bf16 tolerance (stated): on the tokens the engine chose, transformers' bf16 log-probs agree
within 0.05 nats, and every greedy choice is transformers' argmax or within 0.05 nats of it
(bf16 rounding can flip near-ties, after which free-running texts legitimately part ways).

Run on the device: python3 -m pytest -q -m cuda tests/rollout/test_engine_cuda.py
Each test puts its engines to sleep(2) at the end: memory_saver pools live as long as the
process, so an engine that is merely dropped would keep its physical pages.
"""

from __future__ import annotations

import pytest
import torch

from handoff.rollout.engine import Engine
from handoff.rollout.models import iter_checkpoint
from handoff.rollout.sampling import SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_NATS = 0.05
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def _hf_bf16(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()


@torch.no_grad()
def _check_against_hf(hf, prompt, sample, *, greedy: bool) -> None:
    ids = torch.tensor([prompt + sample.token_ids], device="cuda")
    logp = hf(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(sample.token_ids, device="cuda")[:, None]).squeeze(1)
    assert (chosen.cpu() - torch.tensor(sample.logprobs)).abs().max() < BF16_NATS
    if greedy:
        assert (logp.max(-1).values - chosen).max() < BF16_NATS


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("which", ["qwen3_dir", "llama_dir"])
def test_bf16_matches_transformers(which, backend, ref, request):
    path = request.getfixturevalue(which)
    # The default decode GEMM choice (auto: timed per batch size); the check is a tolerance,
    # which any BLAS library's rounding meets.
    engine = Engine(str(path), ref.cfg(num_blocks=512, block_size=16, decode_gemm="auto"),
                    dtype="bfloat16", attention_backend=backend)
    assert engine.runner.backend == ("torch" if backend == "torch" else "triton")
    hf = _hf_bf16(path)
    greedy = engine.generate(ref.mixed_prompts, SamplingParams(temperature=0.0, n=2, max_tokens=32))
    for prompt, out in zip(ref.mixed_prompts, greedy):
        assert out.outputs[0].token_ids == out.outputs[1].token_ids
        _check_against_hf(hf, prompt, out.outputs[0], greedy=True)
    sampled = engine.generate(ref.mixed_prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=32))
    for prompt, out in zip(ref.mixed_prompts, sampled):
        _check_against_hf(hf, prompt, out.outputs[0], greedy=False)
    engine.sleep(2)


def test_pool_sized_from_utilization_and_memory_really_moves(qwen3_dir, ref):
    util = 0.1  # ~14 GB of KV on a 141 GB card
    engine = Engine(str(qwen3_dir), ref.cfg(num_blocks=None, block_size=16,
                                            gpu_memory_utilization=util, max_model_len=512),
                    dtype="bfloat16")
    stats = engine.stats()
    kv_bytes, block_bytes = stats["kv_cache_bytes"], stats["kv_block_bytes"]
    _, total = torch.cuda.mem_get_info()
    own = engine.pool.region_bytes("weights")
    budget = (util * total - own - stats["activation_peak_bytes"]  # the source's ledger
              - stats["graph_reserve_bytes"])
    assert budget - block_bytes < kv_bytes <= budget
    assert 0 < stats["activation_peak_bytes"] < 2**30
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    before = engine.generate(ref.mixed_prompts, GREEDY)

    engine.sleep(2)
    torch.cuda.synchronize()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_awake > 0.95 * kv_bytes
    engine.wake_up(["weights"])
    engine.load_weights(iter_checkpoint(qwen3_dir))
    free_weights, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_weights < 0.05 * kv_bytes  # weights are tiny; KV still asleep
    engine.wake_up(["kv_cache"])
    free_woken, _ = torch.cuda.mem_get_info()
    assert free_weights - free_woken > 0.95 * kv_bytes
    assert not engine.runner.kv_storage.view(torch.uint8).any()
    after = engine.generate(ref.mixed_prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    print(f"\nkv pool {kv_bytes / 2**30:.2f} GiB ({stats['num_blocks']} blocks) at util "
          f"{util:.2f}; sleep freed {(free_asleep - free_awake) / 2**30:.2f} GiB")
    engine.sleep(2)


def test_new_weights_after_wake_equal_a_fresh_engine(qwen3_dir, ref, tmp_path):
    other = ref.write_checkpoint("tiny-qwen3", tmp_path / "other", seed=2)
    cfg = ref.cfg(num_blocks=512, block_size=16)
    engine = Engine(str(qwen3_dir), cfg, dtype="bfloat16")
    old = engine.generate(ref.mixed_prompts, GREEDY)
    for _ in range(3):
        engine.sleep(2)
        engine.wake_up(["weights"])
        engine.load_weights(iter_checkpoint(other))
        engine.wake_up(["kv_cache"])
        engine.reset_prefix_cache()
    new = engine.generate(ref.mixed_prompts, GREEDY)
    fresh_engine = Engine(str(other), cfg, dtype="bfloat16")
    fresh = fresh_engine.generate(ref.mixed_prompts, GREEDY)
    tokens = [[s.token_ids for s in o.outputs] for o in new]
    assert tokens == [[s.token_ids for s in o.outputs] for o in fresh]
    assert tokens != [[s.token_ids for s in o.outputs] for o in old]
    engine.sleep(2)
    fresh_engine.sleep(2)


def test_fp8_kv_on_cuda_stays_close_to_bf16(qwen3_dir, ref):
    cfg = ref.cfg(num_blocks=512, block_size=16)
    bf16 = Engine(str(qwen3_dir), cfg, dtype="bfloat16")
    fp8 = Engine(str(qwen3_dir), ref.cfg(num_blocks=512, block_size=16, kv_dtype="fp8"),
                 dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for a, b in zip(bf16.generate(ref.mixed_prompts, params), fp8.generate(ref.mixed_prompts, params)):
        assert abs(a.outputs[0].logprobs[0] - b.outputs[0].logprobs[0]) < 0.15
    fp8.sleep(2)
    fp8.wake_up(["weights"])
    fp8.load_weights(iter_checkpoint(qwen3_dir))
    fp8.wake_up(["kv_cache"])
    assert not fp8.runner.kv_storage.view(torch.uint8).any()
    assert torch.equal(fp8.runner.kv_scales, torch.ones_like(fp8.runner.kv_scales))
    assert fp8.generate(ref.mixed_prompts, params)[0].outputs[0].token_ids
    bf16.sleep(2)
    fp8.sleep(2)


def test_results_by_kernel_equal_results_by_copy(qwen3_dir, ref):
    """rollout.readback_by_kernel on and off: the same tokens and log-probs, bit for bit."""
    outs = {}
    sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=32)
    for by_kernel in (True, False):
        engine = Engine(str(qwen3_dir), ref.cfg(num_blocks=512, block_size=16,
                                                readback_by_kernel=by_kernel), dtype="bfloat16")
        assert engine.runner.readback_by_kernel is by_kernel
        done = engine.generate(ref.mixed_prompts, sampled)
        outs[by_kernel] = [(s.token_ids, s.logprobs) for o in done for s in o.outputs]
        engine.sleep(2)
    assert outs[True] == outs[False]


def test_the_l2_prefetch_and_pdl_change_launches_not_values(qwen3_dir, ref, monkeypatch):
    """Each layer's next weights asked for in L2 on a side stream (HANDOFF_L2_PREFETCH), the
    small kernels launched with PDL (HANDOFF_PDL), both captured in the decode graphs: greedy
    tokens and log-probs bit-equal to the engine's without them."""
    from handoff.rollout.kernels.pdl import pdl_on

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk L2 prefetch and PDL need sm_90+")
    outs = []
    for prefetch, pdl in (("0", "0"), ("o+gu16+qkv8", "0"), ("0", "1"), ("o+gu16", "1")):
        monkeypatch.setenv("HANDOFF_L2_PREFETCH", prefetch)
        monkeypatch.setenv("HANDOFF_PDL", pdl)
        assert pdl_on(torch.zeros(1, device="cuda")) == (pdl == "1")
        engine = Engine(str(qwen3_dir), ref.cfg(num_blocks=512, block_size=16), dtype="bfloat16")
        assert (engine.runner.prefetch is None) == (prefetch == "0")
        assert engine.runner.graphs is not None
        outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in engine.generate(ref.mixed_prompts, GREEDY)])
        engine.sleep(2)
    assert all(out == outs[0] for out in outs[1:])
