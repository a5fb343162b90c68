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
    result = run_engine_bench(models=["tiny-qwen3"], batches=[1, 3], prompt_len=8, new_tokens=6,
                              hf_new_tokens=3, public_model="tiny-qwen3", public_seqs=4,
                              public_lengths=(4, 20), device="cpu", dtype="float32",
                              workdir=str(tmp_path))
    entry = result["models"]["tiny-qwen3"]
    assert [r["batch"] for r in entry["rows"]] == [1, 3]
    assert entry["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 kv heads x 16, fp32
    assert entry["graph_captures"] == 0 and not entry["packed_prefill"]  # CPU: eager paths
    for row in entry["rows"]:
        assert row["decode_steps"] == 5  # the first of 6 tokens comes from the prefill
        assert 0 < row["host_ms_per_step"] <= row["ms_per_step"]
        assert row["over_floor"] == pytest.approx(row["ms_per_step"] / row["floor_ms"])
        assert row["hf_ms_per_step"] == entry["transformers"][row["batch"]]["ms_per_step"]
    assert result["copy_bytes_per_s"] > 0
    pub = result["public"]
    assert pub["num_seqs"] == 4 and 16 <= pub["output_tokens"] <= 80
    assert pub["tokens_per_s"] == pytest.approx(pub["output_tokens"] / pub["wall_s"])
    out = io.StringIO()
    from rich.console import Console

    render(result, Console(file=out, width=80))
    text = out.getvalue()
    assert "tiny-qwen3" in text and "public workload" in text and "x floor" in text
