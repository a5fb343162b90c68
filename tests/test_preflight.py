"""preflight: the checks `handoff train` makes before loading anything."""

import json
from pathlib import Path

import pytest

from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.preflight import preflight


@pytest.fixture
def cfg(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                   f"run.out_dir={tmp_path / 'run'}",
                                                   "run.steps=3", "run.resume=true"])


def _checkpoint(cfg, step):
    root = Path(cfg.run.out_dir) / "checkpoints"
    name = f"step_{step:08d}_x"
    (root / name).mkdir(parents=True)
    (root / name / "meta.json").write_text(json.dumps({"step": step}))
    (root / "latest").write_text(name)


def test_resume_of_a_finished_run_fails_before_loading(cfg):
    _checkpoint(cfg, 3)
    with pytest.raises(HandoffError, match="at step 3, run.steps=3: raise run.steps"):
        preflight(cfg)


def test_resume_with_steps_left_or_nothing_to_resume_passes(cfg):
    assert preflight(cfg) is None  # no checkpoint yet: a fresh start
    _checkpoint(cfg, 2)
    assert preflight(cfg) is None
