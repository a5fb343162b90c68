"""The host-side decode step bench runs and keeps every sequence in the batch."""

from __future__ import annotations

from handoff.bench.host_step import host_step_cost


def test_host_step_cost_reports_per_phase_times():
    result = host_step_cost(32, prompt_len=20, block_size=4, steps=12, warmup=2, vocab=1000)
    assert result["num_seqs"] == 32 and result["steps"] == 12
    phases = result["phase_ms_median"]
    assert set(phases) == {"schedule", "inputs", "sampling_inputs", "postprocess"}
    assert all(v > 0 for v in phases.values())
    assert result["ms_per_step_median"] >= sum(phases.values()) * 0.5
    assert result["ms_per_step_p90"] >= result["ms_per_step_median"]
