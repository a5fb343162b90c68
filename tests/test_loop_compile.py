"""A run with compiled layers: the decision in the console and the summary, the graphs each
step compiled in its row (`actor/compiles`), and the warm mark its compile leaves for the
next run's plan."""

import json

import pytest
import torch

from handoff import compile_cache
from handoff.config import load_config
from handoff.loop import Run
from handoff.modelzoo import init_model
from handoff.runplan import RunPlan
from handoff.trainer import compiled


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("compile-model"), dtype="float32")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HANDOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compile_cache, "_active", False)


def _cfg(model_dir, out_dir, *extra):
    # No reference and nothing offloaded: the least work around the trainer's passes.
    return load_config("examples/cpu-tiny.yaml", [
        f"model.path={model_dir}", f"run.out_dir={out_dir}", "run.checkpoint=false",
        "actor.kl_coef=0", "memory.param_offload=false", "memory.optimizer_offload=false",
        "memory.ref_offload=false", *extra])


@pytest.mark.slow
def test_each_step_counts_the_graphs_it_compiled(model_dir, tmp_path, monkeypatch, capsys):
    # Dynamo's capture decides what compiles; its plain backend skips code generation.
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    torch._dynamo.reset()
    cfg = _cfg(model_dir, tmp_path / "run", "actor.compile=true", "actor.micro_batch_tokens=64",
               "rollout.response_lengths=uniform:min=1,max=8")
    assert not RunPlan.build(cfg).compile.warm
    summary = Run(cfg).run()
    assert "compiled layers: on (actor.compile=true)" in capsys.readouterr().out
    rows = [json.loads(line)
            for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Step 1 compiles (the update's forward and backward); step 2's packed micro-batches of
    # other token counts compile nothing.
    assert rows[0]["train_tokens"] != rows[1]["train_tokens"]
    assert rows[0]["actor/compiles"] > 0 and rows[1]["actor/compiles"] == 0
    assert summary["compile"]["on"] and summary["compile"]["reason"] == "actor.compile=true"
    assert "Compiled layers: on" in (tmp_path / "run" / "summary.md").read_text()
    # The compile went to this cache: the next run of this shape is priced warm.
    assert RunPlan.build(cfg).compile.warm


def test_an_eager_run_has_no_compile_count(model_dir, tmp_path, capsys):
    trainer = Run(_cfg(model_dir, tmp_path / "run", "run.steps=1"))
    assert not compiled.layers_compiled(trainer.worker.actor.module)
    assert "actor/compiles" not in trainer.step(0)
    assert not (tmp_path / "cache" / "compile").exists()
