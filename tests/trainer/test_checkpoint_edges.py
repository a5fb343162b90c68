"""Checkpoint edges: a Ctrl-C inside DCP comes out as a KeyboardInterrupt (DCP wraps it in a
CheckpointException), a prune renames before it deletes (a kill inside leaves nothing a later
save cannot remove), and run.keep_checkpoints bounds what stays on disk."""

import shutil

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from handoff.config import ActorConfig, load_config
from handoff.errors import HandoffError
from handoff.modelzoo import init_model
from handoff.trainer import checkpoint as checkpoint_module
from handoff.trainer.actor import Actor
from handoff.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    model = init_model("tiny-qwen3", tmp_path_factory.mktemp("edges-model"), dtype="float32")
    return Actor(str(model), actor=ActorConfig(), dtype="float32")


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_ctrl_c_inside_a_save_is_a_keyboard_interrupt_and_the_last_checkpoint_stays(
        actor, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, actor, step=1)
    before = latest_checkpoint(root)
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", _interrupt)
    with pytest.raises(CheckpointException):   # what DCP itself raises: the Ctrl-C wrapped
        dcp.save({"x": actor.part_tensors("params")[0]},
                 storage_writer=dcp.FileSystemWriter(tmp_path / "plain"))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, actor, step=2)
    assert not list(root.glob(".tmp_*")) and latest_checkpoint(root) == before


def test_ctrl_c_inside_a_load_is_a_keyboard_interrupt_not_a_model_mismatch(actor, tmp_path,
                                                                          monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, actor, step=1)
    monkeypatch.setattr(dcp.FileSystemReader, "read_data", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(root, actor)


def test_ctrl_c_between_the_files_of_a_save_leaves_a_temp_dir_the_next_save_removes(
        actor, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    monkeypatch.setattr(checkpoint_module, "file_hashes", _interrupt)   # outside DCP
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, actor, step=1)
    monkeypatch.undo()
    assert latest_checkpoint(root) is None
    save_checkpoint(root, actor, step=1)
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_a_kill_inside_a_prune_leaves_only_a_trash_dir_that_the_next_prune_removes(
        actor, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, actor, step=step, keep=2)
    oldest = sorted(p.name for p in root.glob("step_*"))[0]

    def killed_half_way(path, ignore_errors=False):
        (path / "meta.json").unlink()   # what rmtree deletes first on this filesystem, say
        raise SystemExit("killed")     # stands in for kill -9: nothing after it runs

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_half_way)
    with pytest.raises(SystemExit):
        save_checkpoint(root, actor, step=3, keep=2)
    monkeypatch.undo()
    names = sorted(p.name for p in root.iterdir())
    # The half-deleted checkpoint is no longer a step_* directory: nothing can take it for
    # one, and its name says it goes.
    assert f".trash_{oldest}" in names and oldest not in names
    assert latest_checkpoint(root).name.startswith("step_00000003_")
    info = load_checkpoint(root, actor)   # a load removes it too
    assert info["step"] == 3 and not list(root.glob(".trash_*"))
    (root / f".trash_{oldest}").mkdir()
    save_checkpoint(root, actor, step=4, keep=2)
    assert not list(root.glob(".trash_*"))


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_checkpoints_keeps_the_newest_k(actor, tmp_path, keep):
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        save_checkpoint(root, actor, step=step, keep=keep)
    kept = sorted(p.name[:13] for p in root.glob("step_*"))
    assert kept == [f"step_{s:08d}" for s in range(6 - keep, 6)]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_keep_checkpoints_is_a_positive_run_setting():
    assert load_config(None, []).run.keep_checkpoints == 2
    assert load_config(None, ["run.keep_checkpoints=5"]).run.keep_checkpoints == 5
    for bad in ("0", "-1", "two"):
        with pytest.raises((HandoffError, ValueError), match="run.keep_checkpoints"):
            load_config(None, [f"run.keep_checkpoints={bad}"])


def test_a_linked_checkpoints_directory_is_refused_by_a_save(actor, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(outside, target_is_directory=True)
    with pytest.raises(HandoffError, match="checkpoints is a symbolic link"):
        save_checkpoint(tmp_path / "run" / "checkpoints", actor, step=1)
    assert list(outside.iterdir()) == []
    shutil.rmtree(outside)
