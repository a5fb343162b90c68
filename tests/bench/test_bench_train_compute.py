"""`handoff bench train-compute` on CPU with a tiny model: both variants in one run."""

import pytest

from handoff.bench.train_compute import (builtin_variants, parse_variant, response_lengths,
                                         run_train_compute_bench)
from handoff.errors import HandoffError
from handoff.modelzoo import init_model
from handoff.plan.shapes import PRESETS, count_params


def test_response_length_specs_and_variants():
    assert response_lengths("5", 3) == [5, 5, 5]
    assert response_lengths("2,7", 3) == [2, 7, 2]
    assert all(3 <= n <= 9 for n in response_lengths("uniform:3:9", 50))
    tail = response_lengths("longtail:20:400", 64)
    assert max(tail) == 400 and sorted(tail)[32] < 60
    with pytest.raises(HandoffError, match="longtail"):
        response_lengths("tail:1", 4)
    base = builtin_variants(16, True)
    assert parse_variant("padded", base) == ("padded", base["padded"])
    name, s = parse_variant("big:micro_batch_tokens=32768,gradient_checkpointing=true", base)
    assert name == "big" and s["micro_batch_tokens"] == "32768" and s["logprob_chunk_tokens"] == 2048
    with pytest.raises(HandoffError, match="key=value"):
        parse_variant("x:lr=3", base)


def test_bench_runs_padded_and_packed_in_one_call(tmp_path):
    ckpt = str(init_model("tiny-qwen3", tmp_path / "m", dtype="float32"))
    r = run_train_compute_bench(ckpt, device="cpu", dtype="float32", rows=4, group=2,
                                prompt_len=4, response_lens="2,9,3,14", micro_batch_size=2,
                                repeats=1, variants=["padded", "packed"])
    tokens = 4 * 4 + (2 + 9 + 3 + 14)
    assert r["batch"]["tokens"] == tokens
    assert r["model_flops"] == 8 * count_params(PRESETS["tiny-qwen3"]) * tokens   # tied
    padded, packed = r["variants"]
    assert (padded["name"], packed["name"]) == ("padded", "packed")
    assert padded["computed_tokens"] == 2 * 13 + 2 * 18 > packed["computed_tokens"] == tokens
    assert packed["settings"]["micro_batch_tokens"] > 0 and packed["micro_batches"] == 1
    assert packed["attention"] == "padded_sdpa"
    for v in (padded, packed):
        assert not v["oom"] and v["mfu"] > 0 and v["tokens_per_s"] > 0
        assert set(v["parts"]) == {"ref_forward", "actor_forward_backward", "optimizer_step"}
        prof = v["profile"]
        assert prof["launches"] > 0 and prof["categories"]["gemm"] > 0
        assert prof["categories"]["optimizer"] > 0 and prof["categories"]["logprob_head"] > 0
    assert padded["profile"]["recompute_seconds"] > 0          # checkpointing on
    assert packed["profile"]["recompute_seconds"] == 0         # auto: the CPU has room


def test_profile_keeps_host_copies_out_of_compute_and_names_top_kernels():
    """Kernels go by the op that launched them, a host<->card memcpy to host_copies (the
    copy engines run it beside the compute: not in total_seconds), each category's largest
    kernels named."""
    from types import SimpleNamespace as NS

    import torch

    from handoff.bench.train_profile import summarize

    cpu = torch.autograd.DeviceType.CPU

    def op(name, kernels, parent=None):
        return NS(name=name, device_type=cpu, cpu_parent=parent,
                  kernels=[NS(name=k, duration=us) for k, us in kernels])

    step = op("handoff.optimizer_step", [])
    events = [op("aten::mm", [("nvjet_gemm", 3000.0)]),
              op("aten::copy_", [("Memcpy HtoD (Pinned -> Device)", 9000.0),
                                 ("elementwise_copy_bf16", 500.0)]),
              op("aten::copy_", [("elementwise_copy_bf16", 250.0)]),
              op("aten::mul", [("vectorized_mul", 1000.0)]),
              op("aten::_foreach_mul_", [("multi_tensor_apply", 200.0)], parent=step)]
    r = summarize(NS(events=lambda: events), torch.device("cuda"))
    cats = r["categories"]
    assert cats["host_copies"] == pytest.approx(9e-3) and cats["copies"] == pytest.approx(7.5e-4)
    assert cats["gemm"] == pytest.approx(3e-3) and cats["optimizer"] == pytest.approx(2e-4)
    assert r["total_seconds"] == pytest.approx(3e-3 + 7.5e-4 + 1e-3 + 2e-4)
    assert r["launches"] == 6
    assert r["top_kernels"]["copies"] == [["elementwise_copy_bf16", pytest.approx(7.5e-4)]]
    assert r["top_kernels"]["elementwise_norm"][0][0] == "vectorized_mul"
