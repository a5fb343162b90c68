"""RunReport's TensorBoard events agree with metrics.jsonl after a resume or a fresh start."""

from types import SimpleNamespace

import pytest
import torch

from handoff.config import load_config
from handoff.run_report import RunReport


def _report(tmp_path):
    cfg = load_config("examples/cpu-tiny.yaml", ["model.path=tiny-qwen3",
                                                 f"run.out_dir={tmp_path}", "run.steps=3"])
    worker = SimpleNamespace(device=torch.device("cpu"), start_rates={},
                             actor=SimpleNamespace(module=torch.nn.Linear(2, 2),
                                                   memory_parts=lambda: {"optimizer": 0}),
                             pool=SimpleNamespace(region_bytes=lambda tag: 0))
    return RunReport(cfg, worker, tmp_path)


def _log(report, first_step, rewards):
    report.start(first_step)
    for step, reward in enumerate(rewards, start=first_step + 1):
        report.log_step({"step": step, "reward_mean": reward, "reward_std": 0.0,
                         "response_length": 1.0, "timing_s/gen": 0.0, "timing_s/step": 0.0})
    report._progress.stop()
    report._tb.close()


def test_resumed_steps_replace_the_crashed_runs_events(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

    _log(_report(tmp_path), 0, [0.1, 0.2, 0.3])   # steps 1-3; say step 1's checkpoint survived
    _log(_report(tmp_path), 1, [0.5, 0.6])        # the resume repeats steps 2 and 3
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    points = [(e.step, round(e.value, 3)) for e in events.Scalars("reward_mean")]
    assert points == [(1, 0.1), (2, 0.5), (3, 0.6)]
