"""Crash consistency: a run killed with SIGKILL inside a checkpoint save, inside a metrics
row, inside a prune, between a checkpoint and its publication, and after its last checkpoint
but before its summary, resumed each time with --resume, ends as an uninterrupted run does:
every step's metrics row exactly once and the same numbers, bit for bit, the same final
weights, the newest run.keep_checkpoints checkpoints and nothing half-written left."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from handoff.modelzoo import init_model
from handoff.run_dir import read_metrics

JOB = Path(__file__).parent / "crash_run_job.py"
SRC = Path(__file__).resolve().parents[1] / "src"
# What a step computes (not how long it took): equal bit for bit after any resume.
COMPUTED = ("step", "reward_mean", "reward_std", "response_length", "prompt_length",
            "train_tokens", "loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac",
            "num_tokens", "sync/bytes", "engine/decode_steps")
# (point, which time it is reached) per run, each run resuming the one before; steps=4,
# a checkpoint every step, one kept (every save after the first prunes).
KILLS = [("save", 2),      # inside step 2's save: step 1 is the last checkpoint
         ("metrics", 1),   # half of step 2's row: its checkpoint complete but unpublished
         ("prune", 1),     # step 2 published, its prune cut after one deleted file
         ("publish", 2),   # step 4's row written, `latest` still at step 3
         ("summary", 1)]   # every checkpoint written, the summary not


def _train(model, out, point="none", n=0, resume=True):
    args = ["train", "examples/cpu-tiny.yaml", f"model.path={model}", f"run.out_dir={out}",
            "run.steps=4", "run.save_every=1", "run.keep_checkpoints=1"]
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.Popen([sys.executable, str(JOB), point, str(n), *args,
                             *(["--resume"] if resume else [])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _shards(out: Path) -> dict[str, str]:
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(latest.glob("*.distcp"))}


@pytest.mark.slow
def test_kills_at_each_crash_point_resume_to_the_uninterrupted_run(tmp_path):
    model = init_model("tiny-qwen3", tmp_path / "model", dtype="float32")
    reference = _train(model, tmp_path / "reference", resume=False)   # beside the chain
    out = tmp_path / "killed"
    for i, (point, n) in enumerate(KILLS):
        job = _train(model, out, point, n, resume=i > 0)
        log = job.communicate(timeout=600)[0]
        assert job.returncode == -9, f"{point}: {log[-3000:]}"
    final = _train(model, out)
    log = final.communicate(timeout=600)[0]
    assert final.returncode == 0, log[-3000:]
    assert reference.wait(timeout=600) == 0, reference.stdout.read()[-3000:]

    rows, problem = read_metrics(out / "metrics.jsonl")
    expected, _ = read_metrics(tmp_path / "reference" / "metrics.jsonl")
    assert problem is None and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [{k: r.get(k) for k in COMPUTED} for r in rows] == \
        [{k: r.get(k) for k in COMPUTED} for r in expected]
    assert _shards(out) == _shards(tmp_path / "reference") != {}
    # The last resume found every checkpoint written and finished the run: its summary.
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len([n for n in names if n.startswith("step_")]) == 1, names
    assert not [n for n in names if n.startswith(".")], names
