"""The console's step line and summary caption say only what is true of the run: no kl
without a reference model, and why an exposed switch can be longer than the switch."""

import io

import pytest
from rich.console import Console

from handoff import run_report
from handoff.calibrate import Rates
from handoff.config import load_config
from handoff.memory.meter import MemoryMeter
from handoff.run_report import HOST_WORK, RunReport, step_line, summary_table
from handoff.runplan import RunPlan

ROW = {"step": 4, "reward_mean": 0.5, "reward_std": 0.1, "response_length": 7.0, "kl": 0.0123,
       "timing_s/gen": 1.0, "timing_s/step": 2.0}


def _printed_lines(tmp_path, monkeypatch, kl_coef, row):
    out = io.StringIO()
    monkeypatch.setattr(run_report, "console", Console(file=out, width=300))
    cfg = load_config("examples/cpu-tiny.yaml", ["model.path=tiny-qwen3", "run.steps=5",
                                                 f"run.out_dir={tmp_path}",
                                                 f"actor.kl_coef={kl_coef}"])
    report = RunReport(RunPlan.build(cfg), tmp_path, rates=Rates({}), meter=MemoryMeter("cpu"),
                       kv_pool_bytes=0)
    report.start(0)
    report.log_step(row)
    report._progress.stop()
    if report._loggers is not None:
        report._loggers.close()
    return [line for line in out.getvalue().splitlines() if line.startswith("step")]


@pytest.mark.parametrize("kl_coef, shown", [(0.0, False), (0.01, True)])
def test_kl_is_printed_only_with_a_reference_model(tmp_path, monkeypatch, kl_coef, shown):
    row = {**ROW, "kl": 0.0} if not shown else ROW
    (line,) = _printed_lines(tmp_path, monkeypatch, kl_coef, row)
    assert ("kl 0.0123" in line) is shown and ("kl " in line) is shown
    assert "reward 0.500" in line and "gen 1.00s" in line


@pytest.mark.parametrize("raw, exposed, why", [(0.2, 0.35, True), (0.35, 0.2, False),
                                               (0.3, 0.3, False), (0.0, 0.01, True)])
def test_an_exposed_switch_longer_than_the_switch_says_it_holds_host_work(raw, exposed, why):
    line = step_line({**ROW, "switch/raw_s": raw, "switch/exposed_s": exposed}, kl=False)
    assert f"switch {raw:.2f}s (exposed {exposed:.2f}s" in line
    assert (HOST_WORK in line) is why
    assert "exposed" not in step_line(ROW, kl=False)   # a row from before memory.overlap


@pytest.mark.parametrize("raw, exposed, why", [(0.2, 0.35, True), (0.35, 0.2, False)])
def test_the_summary_caption_says_it_too(raw, exposed, why):
    actions = run_report.SWITCH_ACTIONS
    summary = {"steps": 3, "planned": {a: {"bytes": 0, "seconds": 0.0} for a in actions},
               "measured": {a: {"bytes": 0, "seconds": 0.0} for a in actions},
               "switch_seconds": raw, "step_seconds": 2.0, "switch_share": raw / 2.0,
               "exposed_seconds": exposed, "raw_seconds": raw, "planned_exposed_seconds": 0.1,
               "reward_first": 0.1, "reward_last": 0.2}
    assert (HOST_WORK in summary_table(summary).caption) is why
