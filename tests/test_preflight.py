"""preflight: the checks `handoff train` makes before loading anything."""

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.modelzoo import build_byte_tokenizer
from handoff.plan.shapes import PRESETS, load_shape
from handoff.preflight import checkpoint_bytes, preflight
from handoff.runplan import RunPlan
from handoff.trainer.checkpoint_files import FORMAT


@pytest.fixture
def cfg(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PRESETS["tiny-qwen3"]))
    build_byte_tokenizer().save_pretrained(model)   # preflight renders its template
    header = b'{"__metadata__":{"format":"pt"}}'   # a complete safetensors file, no tensors
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                   f"run.out_dir={tmp_path / 'run'}",
                                                   "run.steps=3", "run.resume=true"])


def _checkpoint(cfg, step):
    """A checkpoint as a handoff run leaves it (the run's lock file beside it)."""
    root = Path(cfg.run.out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    (root.parent / ".handoff.lock").touch()
    name = f"step_{step:08d}_x"
    (root / name).mkdir(parents=True)
    meta = {"format": FORMAT, "step": step, "optimizer_step": step, "world_size": 1,
            "extra": {"task": {"name": "arithmetic", "seed": 0, "position": 4 * step}}}
    (root / name / "meta.json").write_text(json.dumps(meta))
    (root / "latest").write_text(name)


def test_resume_of_a_finished_run_fails_before_loading(cfg):
    _checkpoint(cfg, 3)
    preflight(cfg)   # killed before its summary: passes, the resume writes it
    (Path(cfg.run.out_dir) / "summary.json").write_text("{}")
    with pytest.raises(HandoffError, match="at step 3, run.steps=3: raise run.steps"):
        preflight(cfg)
    _checkpoint(cfg, 4)
    (Path(cfg.run.out_dir) / "summary.json").unlink()
    with pytest.raises(HandoffError, match="at step 4, run.steps=3: raise run.steps"):
        preflight(cfg)


def test_resume_with_steps_left_or_nothing_to_resume_passes(cfg):
    assert isinstance(preflight(cfg), RunPlan)  # no checkpoint yet: a fresh start
    _checkpoint(cfg, 2)
    assert isinstance(preflight(cfg), RunPlan)


Usage = namedtuple("Usage", "total used free")


def _with(cfg, *overrides):
    return load_config("examples/cpu-tiny.yaml", [f"model.path={cfg.model.path}",
                                                   f"run.out_dir={cfg.run.out_dir}",
                                                   "run.resume=true", *overrides])


def _free_disk(monkeypatch, free):
    seen = []

    def usage(path):
        seen.append(Path(path))
        return Usage(10 * free, 9 * free, free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return seen


def test_checkpoint_bytes_are_params_master_and_adam(cfg):
    from handoff.trainer.checkpoint_files import FILE_OVERHEAD_BYTES, RNG_FILE_BYTES

    shape = load_shape(cfg.model.path)
    n, files = shape.num_params, shape.num_tensors
    # cpu-tiny is fp32: its params are their own master; a file per tensor and moment.
    assert checkpoint_bytes(RunPlan.build(cfg)) == 12 * n + 3 * files * FILE_OVERHEAD_BYTES + RNG_FILE_BYTES
    # bf16 params 2 + fp32 master 4 + Adam 8: a 4B model's checkpoint is ~56 GB.
    assert checkpoint_bytes(RunPlan.build(_with(cfg, "model.dtype=bfloat16"))) == (
        14 * n + 4 * files * FILE_OVERHEAD_BYTES + RNG_FILE_BYTES)


def test_a_run_whose_checkpoints_cannot_fit_the_disk_is_refused(cfg, monkeypatch):
    # run.steps=3 saving every step: the third save is written while the last two are kept.
    saving = _with(cfg, "run.steps=3", "run.save_every=1", "run.resume=false")
    one = checkpoint_bytes(RunPlan.build(saving))
    seen = _free_disk(monkeypatch, 3 * one - 1)
    with pytest.raises(HandoffError, match=r"checkpoints need .* MB on the filesystem of "
                                           r"run.out_dir.*run.checkpoint=false"):
        preflight(saving)
    assert seen and seen[0].exists()  # out_dir does not exist yet: its nearest parent is asked
    _free_disk(monkeypatch, 3 * one)
    assert isinstance(preflight(saving), RunPlan)
    _free_disk(monkeypatch, 0)
    off = _with(cfg, "run.checkpoint=false")
    assert isinstance(preflight(off), RunPlan)  # nothing to write, nothing to check


def test_checkpoints_already_on_disk_make_room_as_they_are_replaced(cfg, monkeypatch):
    _checkpoint(cfg, 1)
    _checkpoint(cfg, 2)
    resumed = _with(cfg, "run.steps=6", "run.save_every=1")
    one = checkpoint_bytes(RunPlan.build(resumed))
    _free_disk(monkeypatch, one)      # the two kept ones leave as new ones arrive: one more
    assert isinstance(preflight(resumed), RunPlan)
    _free_disk(monkeypatch, one - 1)
    with pytest.raises(HandoffError, match="checkpoints need"):
        preflight(resumed)


def test_a_logger_whose_package_is_missing_fails_before_loading(cfg, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg.run.loggers = ["tensorboard", "mlflow"]
    with pytest.raises(HandoffError, match=r"pip install 'handoff\[mlflow\]'"):
        preflight(cfg)
    cfg.run.loggers = ["tensorboard"]
    preflight(cfg)


def test_lora_sharing_the_base_with_a_tp_engine_is_refused_in_one_line(cfg, tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app

    out = tmp_path / "lora-run"
    res = CliRunner().invoke(app, ["train", "examples/cpu-tiny.yaml",
                                   f"model.path={cfg.model.path}", f"run.out_dir={out}",
                                   "actor.lora.rank=16", "parallel.gpus=2", "parallel.tp=2"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "actor.lora.share_base with parallel.tp=2" in lines[0]
    assert "set actor.lora.share_base=false" in lines[0]
    assert not out.exists()


def test_lora_on_a_shared_base_turns_param_offload_off_with_a_warning(cfg, capsys):
    cfg.actor.lora.rank = 8
    cfg.memory.param_offload = True
    plan = preflight(cfg)
    assert cfg.memory.param_offload is False
    assert "memory.param_offload is off under actor.lora.share_base" in capsys.readouterr().err
    assert plan.order.mode == "lora" and not plan.ref


def test_lora_on_a_shared_base_moves_the_adapters_state_through_the_arena(cfg, capsys):
    cfg.actor.lora.rank = 8
    cfg.memory.param_offload = False
    cfg.memory.offload_mode = "fsdp"
    preflight(cfg)
    assert cfg.memory.offload_mode == "arena"
    assert "memory.offload_mode is arena under actor.lora.share_base" in capsys.readouterr().err
    cfg.actor.lora.share_base = False   # its own FSDP-wrapped base: FSDP's offload stays
    cfg.memory.offload_mode = "fsdp"
    preflight(cfg)
    assert cfg.memory.offload_mode == "fsdp"


def test_a_lora_run_is_checked_against_the_lora_plan(cfg):
    # Qwen3-8B on one H200: fits with LoRA on a shared base (README), not with its full state.
    (Path(cfg.model.path) / "config.json").write_text(json.dumps(PRESETS["qwen3-8b"]))
    cfg.hardware.name = "h200"
    cfg.run.resume = False
    cfg.rollout.max_model_len = 4096
    cfg.run.checkpoint = False   # 8B's full checkpoints (115 GB) would not fit this disk
    with pytest.raises(HandoffError, match="the planner says this run cannot fit"):
        preflight(cfg)
    cfg.actor.lora.rank = 16
    cfg.run.checkpoint = True    # a LoRA checkpoint: the adapters (~0.7 GB with Adam)
    assert preflight(cfg).order.mode == "lora"
    assert checkpoint_bytes(RunPlan.build(cfg)) < 1e9
