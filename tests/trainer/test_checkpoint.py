"""Checkpoints survive kill -9 at any point of a save; stale temp dirs and old ones are pruned."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from handoff.config import ActorConfig
from handoff.modelzoo import init_model
from handoff.trainer.actor import Actor
from handoff.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("m"), dtype="float32"))


def _values(actor):
    return {float(v) for t in actor.part_tensors("params") + actor.part_tensors("optimizer")
            for v in t.unique()}


MODES = ("mid_write", "before_latest")


@pytest.fixture(scope="module")
def killed(ckpt, tmp_path_factory):
    """Both kill points at once (the two children import torch in parallel): mode -> root."""
    roots = {m: tmp_path_factory.mktemp(m) / "ckpt" for m in MODES}
    procs = {m: subprocess.Popen([sys.executable, str(HERE / "ckpt_kill_job.py"), m, ckpt,
                                  str(roots[m])], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for m in MODES}
    logs = {}
    for m, proc in procs.items():
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("STALL"):
                    break
        finally:
            proc.kill()                                   # SIGKILL: no cleanup runs
            proc.wait(timeout=60)
        logs[m] = lines
    return roots, logs


@pytest.mark.parametrize("mode", MODES)
def test_kill_during_save_leaves_the_previous_checkpoint_loadable(ckpt, killed, mode):
    root, lines = killed[0][mode], killed[1][mode]
    assert lines and lines[-1].startswith("STALL"), "".join(lines)[-3000:]
    assert "SAVED 2\n" in lines
    leftovers = sorted(p.name for p in root.iterdir())
    assert any(n.startswith(".tmp_") for n in leftovers) == (mode == "mid_write")

    actor = Actor(ckpt, actor=ActorConfig(), dtype="float32")
    info = load_checkpoint(root, actor)
    assert info["step"] == 2 and info["extra"] == {"data_pos": 20}
    assert _values(actor) == {2.0}                        # every tensor from save 2, none from 3
    assert actor.optimizer.step_count == 0

    save_checkpoint(root, actor, step=3, keep=2)
    names = sorted(p.name for p in root.iterdir())
    assert not any(n.startswith(".tmp_") for n in names)
    assert latest_checkpoint(root).name.startswith("step_00000003_")
    assert len([n for n in names if n.startswith("step_")]) == 2


def test_no_checkpoint_yet_means_nothing_to_resume(ckpt, tmp_path):
    actor = Actor(ckpt, actor=ActorConfig(), dtype="float32")
    assert latest_checkpoint(tmp_path) is None
    assert load_checkpoint(tmp_path, actor) is None
    actor.to("host", optimizer=True).wait()
    with pytest.raises(Exception, match="offloaded"):
        save_checkpoint(tmp_path, actor, step=1)
