"""`handoff bench engine` at toy size on CPU: every part runs and the numbers hang together."""

from __future__ import annotations

import io

import pytest
import torch

from handoff.bench.engine import floor_ms, render, run_engine_bench
from handoff.errors import HandoffError


def test_floor_counts_weights_once_and_the_mean_context():
    # 2 sequences, context 100 + 50/2 = 125 tokens of 1000 bytes each, 1 GB of weights, 1 TB/s.
    assert floor_ms(10**9, 1000, 2, 100, 50, 1e12) == pytest.approx(1.00025)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_refuses_cuda_without_a_gpu():
    with pytest.raises(HandoffError, match="no CUDA device"):
        run_engine_bench(models=["tiny-qwen3"], batches=[1])


def test_tiny_run_on_cpu(tmp_path):
    parts = []   # what a run cut short would have kept: the parts measured, in order
    result = run_engine_bench(models=["tiny-qwen3"], batches=[1, 3], prompt_len=8, new_tokens=6,
                              hf_new_tokens=3, public_model="tiny-qwen3", public_seqs=4,
                              public_lengths=(4, 20), device="cpu", dtype="float32",
                              workdir=str(tmp_path),
                              on_part=lambda name, r: parts.append((name, sorted(r))))
    assert [name for name, _ in parts] == ["tiny-qwen3", "public workload"]
    assert "public" not in parts[0][1] and "public" in parts[1][1]
    entry = result["models"]["tiny-qwen3"]
    assert [r["batch"] for r in entry["rows"]] == [1, 3]
    assert entry["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 kv heads x 16, fp32
    assert entry["graph_captures"] == 0 and not entry["packed_prefill"]  # CPU: eager paths
    for row in entry["rows"]:
        assert row["decode_steps"] == 5  # the first of 6 tokens comes from the prefill
        assert 0 < row["host_ms_per_step"] <= row["ms_per_step"]
        assert row["over_floor"] == pytest.approx(row["ms_per_step"] / row["floor_ms"])
        assert row["floor_ms"] <= row["roofline_ms"] and \
            row["over_roofline"] == pytest.approx(row["ms_per_step"] / row["roofline_ms"])
        assert row["hf_ms_per_step"] == entry["transformers"][row["batch"]]["ms_per_step"]
        assert row["prefill_steps"] >= 1 and row["prefill_s"] > 0
        assert row["prefill_of_peak"] == pytest.approx(
            row["prefill_flops_per_s"] / result["matmul_flops_per_s"])
    assert result["copy_bytes_per_s"] > 0
    pub = result["public"]
    assert pub["num_seqs"] == 4 and 16 <= pub["output_tokens"] <= 80
    assert pub["tokens_per_s"] == pytest.approx(pub["output_tokens"] / pub["wall_s"])
    assert pub["decode_floor_s"] == pytest.approx(pub["decode_read_bytes"]
                                                  / result["copy_bytes_per_s"])
    assert pub["decode_floor_s"] > 0 and pub["decode_over_floor"] > 0
    # The prefills ran once before, apart, and their cached prefixes were then forgotten:
    # the timed run prefills every prompt token again.
    assert pub["first_prefill_s"] > 0 and pub["prefill_steps"] >= 1
    assert pub["prefix_cache_hits"] == 0
    out = io.StringIO()
    from rich.console import Console

    render(result, Console(file=out, width=80))
    text = out.getvalue()
    assert "tiny-qwen3" in text and "public workload" in text and "x floor" in text


def test_lora_rank_decodes_with_an_adapter_beside_the_base_on_cpu(tmp_path):
    from handoff.plan.shapes import PRESETS

    result = run_engine_bench(models=["tiny-qwen3"], batches=[1, 3], prompt_len=8, new_tokens=6,
                              skip_hf=True, public=False, device="cpu", dtype="float32",
                              workdir=str(tmp_path), lora_rank=4)
    entry = result["models"]["tiny-qwen3"]
    lora = entry["lora"]
    # Two engines, the same steps: the base one without adapter code, the other with a
    # rank-4 adapter on every projection of every layer (an A and a B each).
    assert entry["adapter_tensors"] == 0 and entry["lora_rank"] == 0
    assert lora["lora_rank"] == 4
    assert lora["adapter_tensors"] == 2 * 7 * PRESETS["tiny-qwen3"]["num_hidden_layers"]
    assert [r["batch"] for r in lora["rows"]] == [r["batch"] for r in entry["rows"]] == [1, 3]
    for row, lora_row in zip(entry["rows"], lora["rows"]):
        assert row["decode_steps"] == lora_row["decode_steps"] == 5
        assert row["lora_ms_per_step"] == lora_row["ms_per_step"]
        assert row["lora_over_base"] == pytest.approx(lora_row["ms_per_step"] / row["ms_per_step"])
    out = io.StringIO()
    from rich.console import Console

    render(result, Console(file=out, width=80))
    assert "LoRA r4 ms/step" in out.getvalue() and "x base" in out.getvalue()

    with pytest.raises(HandoffError, match="--lora-rank >= 0"):
        run_engine_bench(models=["tiny-qwen3"], batches=[1], device="cpu", lora_rank=-1)
    with pytest.raises(HandoffError, match="--decode-gemm 'cublass'"):
        run_engine_bench(models=["tiny-qwen3"], batches=[1], device="cpu", decode_gemm="cublass")


def test_prefill_flops_count_the_layers_the_causal_pairs_and_one_head_row_per_prompt(tmp_path):
    from handoff.bench.engine import _checkpoint, _engine, prefill_flops

    path = _checkpoint("tiny-qwen3", tmp_path, torch.device("cpu"), "float32")
    engine = _engine(path, max_num_seqs=4, max_model_len=64, device=torch.device("cpu"),
                     dtype=torch.float32, util=0.5)
    s = engine.model.spec
    layers = sum(p.numel() for p in engine.model.model.layers.parameters())
    one = prefill_flops(engine.model, 1, 1)
    # One token: each layer's weights twice, attention to itself, the head once.
    assert one == 2 * layers + 4 * s.num_heads * s.head_dim * s.num_layers \
        + 2 * s.vocab_size * s.hidden_size
    # Three prompts of 10: 30 tokens, 3 x 55 causal pairs, 3 head rows.
    assert prefill_flops(engine.model, 3, 10) == 2 * layers * 30 \
        + 4 * s.num_heads * s.head_dim * s.num_layers * 165 + 3 * 2 * s.vocab_size * s.hidden_size
    engine.sleep(2)


def test_the_profiled_last_step_is_set_against_its_own_contexts():
    from handoff.bench.engine import profiled_step_floor

    # Two sequences at 767 tokens of context, 1000 bytes each, 1 GB of weights, 1 TB/s.
    kernels = {"kernel_ms": 3.2, "attention_ms": 1.0}
    out = profiled_step_floor(kernels, [767, 767], 10**9, 1000, 1e12)
    assert out["profiled_context_mean"] == 767
    assert out["profiled_floor_ms"] == pytest.approx(1.0 + 2 * 767 * 1000 / 1e9)
    assert out["kernel_over_floor"] == pytest.approx(3.2 / out["profiled_floor_ms"])
    assert out["attention_bytes_per_s"] == pytest.approx(2 * 767 * 1000 / 1e-3)
    assert profiled_step_floor({"kernel_ms": 1.0}, [5], 0, 1, 1.0)["attention_bytes_per_s"] is None


def test_the_roofline_takes_the_longer_of_the_weights_bytes_and_their_flops():
    from handoff.bench.engine import roofline_ms

    # 1 GB of bf16 weights (0.5 G params), 1 TB/s, 100 TFLOP/s; 2 sequences at 125 tokens.
    kv = floor_ms(0, 1000, 2, 100, 50, 1e12)
    assert roofline_ms(10**9, 2, 1000, 2, 100, 50, 1e12, 1e14) == pytest.approx(1.0 + kv)
    # 256 rows: 2 x 0.5e9 x 256 = 2.56e11 FLOPs = 2.56 ms, longer than the 1 ms read.
    kv = floor_ms(0, 1000, 256, 100, 50, 1e12)
    assert roofline_ms(10**9, 2, 1000, 256, 100, 50, 1e12, 1e14) == pytest.approx(2.56 + kv)


def test_a_transformers_step_too_short_to_measure_says_so_not_a_number(tmp_path, monkeypatch):
    import itertools
    import types

    import handoff.bench.baselines as baselines

    # A clock under which every generate takes the same second: 1 + n new tokens no longer
    # than 1 (what timing noise gives a tiny model), so the per-step time is not measurable.
    clock = itertools.count(0.0, 1.0)
    monkeypatch.setattr(baselines, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    result = run_engine_bench(models=["tiny-qwen3"], batches=[1], prompt_len=8, new_tokens=6,
                              hf_new_tokens=3, public=False, device="cpu", dtype="float32",
                              workdir=str(tmp_path))
    entry = result["models"]["tiny-qwen3"]
    hf = entry["transformers"][1]
    assert hf["ms_per_step"] is None and hf["tokens_per_s"] is None
    assert "1 + 3 new tokens took 1.0000 s, 1 took 1.0000 s" in hf["not_measurable"]
    row = entry["rows"][0]
    assert row["hf_ms_per_step"] is None and row["speedup_vs_hf"] is None
    assert row["hf_not_measurable"] == hf["not_measurable"]
    out = io.StringIO()
    from rich.console import Console

    render(result, Console(file=out, width=80))
    text = " ".join(out.getvalue().split())
    assert "tiny-qwen3 transformers at batch 1: not measurable (1 + 3 new tokens took" in text
    assert "raise --hf-new-tokens" in text
