"""A step whose loss or gradient norm is not finite stops the run before a checkpoint keeps
its weights (inputs cannot be NaN any more, but an update still can overflow)."""

import math

import pytest

from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.loop import Run, check_finite_update
from handoff.modelzoo import init_model


def test_check_finite_update_names_the_value():
    check_finite_update({"loss": 0.5, "grad_norm": 1.0, "kl": 0.0}, step=3)
    with pytest.raises(HandoffError, match=r"step 3 gave a non-finite grad_norm \(inf\)"):
        check_finite_update({"loss": 0.5, "grad_norm": math.inf}, step=3)
    with pytest.raises(HandoffError, match=r"step 1 gave a non-finite loss \(nan\) before any "
                                           r"update: check model.path's weights"):
        check_finite_update({"loss": math.nan}, step=1)   # no update yet: not actor.lr's fault


def test_a_nan_update_is_never_checkpointed(tmp_path_factory, tmp_path, monkeypatch):
    model = init_model("tiny-qwen3", tmp_path_factory.mktemp("nan-model"), dtype="float32")
    trainer = Run(load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                         f"run.out_dir={tmp_path}"]))
    real = trainer.worker.update

    def nan_update(batch):
        metrics, moves = real(batch)
        return {**metrics, "loss": float("nan")}, moves

    monkeypatch.setattr(trainer.worker, "update", nan_update)
    with pytest.raises(HandoffError, match="step 1 gave a non-finite loss"):
        trainer.step(0, save=True)
    assert not (tmp_path / "checkpoints").exists()
