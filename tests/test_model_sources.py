"""A model directory is data: the trainer and the engine load the same safetensors, a pickle
weight file is never opened, a model's own code never runs (issue 33)."""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from handoff.cli import app
from handoff.errors import HandoffError
from handoff.model_files import ModelFiles, check_model_dir, load_tokenizer, weight_files
from handoff.rollout.models import iter_checkpoint
from handoff.trainer.model import load_hf_model

runner = CliRunner()


class _Payload:
    """Unpickling this creates `marker`: proof that a pickle was opened."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _plant_pickle(path, marker):
    path.write_bytes(pickle.dumps(_Payload(marker)))


def test_the_planted_pickle_does_run_code_when_unpickled(tmp_path):
    # The payload the tests below plant is live: unpickling it creates the marker.
    _plant_pickle(tmp_path / "pytorch_model.bin", tmp_path / "ran")
    pickle.loads((tmp_path / "pytorch_model.bin").read_bytes())
    assert (tmp_path / "ran").exists()


def test_trainer_and_engine_load_the_same_safetensors_and_never_the_pickle(model, tmp_path):
    marker = tmp_path / "unpickled"
    _plant_pickle(model / "pytorch_model.bin", marker)
    # A stray safetensors file beside the checkpoint's: neither side may pick it up.
    save_file({"model.embed_tokens.weight": torch.full((260, 64), 7.0)},
              str(model / "stray.safetensors"))
    assert weight_files(model) == [model / "model.safetensors"]
    check_model_dir(model)
    engine = dict(iter_checkpoint(model))
    trainer = load_hf_model(str(model), torch.float32, False).state_dict()
    expected = load_file(str(model / "model.safetensors"))
    assert set(engine) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(engine[name], tensor), name
        assert torch.equal(trainer[name], tensor), name
    assert not marker.exists()


def test_weights_under_another_name_beside_a_pickle_are_refused_by_both_sides(model, tmp_path):
    marker = tmp_path / "unpickled"
    (model / "model.safetensors").rename(model / "weights.safetensors")
    _plant_pickle(model / "pytorch_model.bin", marker)
    for load in (check_model_dir, lambda m: list(iter_checkpoint(m)),
                 lambda m: load_hf_model(str(m), torch.float32, False)):
        with pytest.raises(HandoffError, match="weights.safetensors is not a name transformers "
                                               "loads .*rename it to model.safetensors"):
            load(model)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickle_only_weights_are_refused_with_the_conversion(model, tmp_path, name):
    marker = tmp_path / "unpickled"
    (model / "model.safetensors").unlink()
    _plant_pickle(model / name, marker)
    res = runner.invoke(app, ["generate", "--model", str(model), "--prompt", "hi"],
                        terminal_width=400)
    line = res.output.strip().splitlines()[-1]
    assert res.exit_code == 2 and line.startswith("error:"), res.output
    assert f"holds pickle weights only ({name})" in line and "safe_serialization=True" in line
    with pytest.raises(HandoffError, match="pickle weights only"):
        load_hf_model(str(model), torch.float32, False)
    assert not marker.exists()


def test_a_sharded_index_is_followed_only_inside_the_directory(model, tmp_path):
    (model / "model.safetensors").rename(model / "part-1.safetensors")
    index = model / "model.safetensors.index.json"
    names = load_file(str(model / "part-1.safetensors"))
    index.write_text(json.dumps({"weight_map": {n: "part-1.safetensors" for n in names}}))
    assert weight_files(model) == [model / "part-1.safetensors"]
    assert set(dict(iter_checkpoint(model))) == set(names)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(model / "part-1.safetensors", outside)
    for bad in ("../outside.safetensors", str(outside), ".."):
        index.write_text(json.dumps({"weight_map": {"x": bad}}))
        with pytest.raises(HandoffError, match="not a file name in"):
            weight_files(model)
    index.write_text(json.dumps({"weight_map": ["part-1.safetensors"]}))
    with pytest.raises(HandoffError, match="field 'weight_map' is .* not a JSON object"):
        weight_files(model)


def _custom_code(model, marker, *, model_type, file="config.json"):
    """Give the directory its own code, which creates `marker` when imported."""
    (model / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                     "from transformers import Qwen3Config as MyConfig\n"
                                     "from transformers import Qwen3ForCausalLM as MyModel\n"
                                     "from transformers import PreTrainedTokenizerFast as MyTok\n")
    data = json.loads((model / file).read_text())
    data["auto_map"] = ({"AutoConfig": "custom.MyConfig", "AutoModelForCausalLM": "custom.MyModel"}
                        if file == "config.json" else {"AutoTokenizer": [None, "custom.MyTok"]})
    if file == "config.json":
        data["model_type"] = model_type
    (model / file).write_text(json.dumps(data))


@pytest.mark.parametrize("model_type,file", [("my-arch", "config.json"),
                                             ("qwen3", "config.json"),
                                             ("qwen3", "tokenizer_config.json")])
def test_custom_model_code_is_refused_and_never_runs(model, tmp_path, monkeypatch, model_type,
                                                    file):
    import io

    marker = tmp_path / "custom-code-ran"
    _custom_code(model, marker, model_type=model_type, file=file)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))   # "run the custom code?": y
    for load in (check_model_dir, ModelFiles.open, load_tokenizer,
                 lambda m: load_hf_model(str(m), torch.float32, False)):
        with pytest.raises(HandoffError, match="names custom code \\(auto_map\\): that "
                                               "architecture is not supported"):
            load(model)
    assert not marker.exists()


def test_custom_code_with_a_terminal_answer_yes_is_refused_without_a_prompt(model, tmp_path):
    marker = tmp_path / "custom-code-ran"
    _custom_code(model, marker, model_type="my-arch")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for args in (["generate", "--model", str(model), "--prompt", "hi"],
                 ["train", "examples/cpu-tiny.yaml", f"model.path={model}",
                  f"run.out_dir={tmp_path / 'run'}"]):
        res = subprocess.run([sys.executable, "-m", "handoff", *args], input="y\ny\ny\n",
                             capture_output=True, text=True, timeout=300, env=env,
                             cwd=os.path.dirname(os.path.dirname(__file__)))
        out = " ".join((res.stdout + res.stderr).split())
        assert res.returncode == 2, out
        assert "architecture is not supported" in out and "[y/N]" not in out
        assert "trust_remote_code" not in out and "Traceback" not in out
    assert not marker.exists()


@pytest.mark.parametrize("change,match", [
    ({"model_type": "mistral"}, "model_type='mistral' is not supported"),
    ({"model_type": None}, "model_type=None is not supported"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "'Qwen3MoeForCausalLM' is not supported"),
    ({"architectures": "Qwen3ForCausalLM"}, "field 'architectures' is 'Qwen3ForCausalLM', not "
                                            "a JSON list"),
])
def test_an_architecture_the_engine_does_not_run_is_refused_before_loading(model, change, match):
    config = json.loads((model / "config.json").read_text())
    config.update(change)
    (model / "config.json").write_text(json.dumps(config))
    for load in (check_model_dir, ModelFiles.open,
                 lambda m: load_hf_model(str(m), torch.float32, False)):
        with pytest.raises(HandoffError, match=match):
            load(model)


def test_every_from_pretrained_in_src_passes_trust_remote_code_false():
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "handoff"
    calls, lax = 0, []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"):
                calls += 1
                flag = {k.arg: k.value for k in node.keywords}.get("trust_remote_code")
                if not (isinstance(flag, ast.Constant) and flag.value is False):
                    lax.append(f"{path.relative_to(src)}:{node.lineno}")
    assert calls >= 5 and lax == []


def test_a_run_opens_its_model_directory_once_for_the_trainer_and_the_engine(model, tmp_path,
                                                                             monkeypatch):
    from handoff.config import load_config
    from handoff.runplan import RunPlan
    from handoff.startup import start_worker

    opened = []
    real_open = ModelFiles.open.__func__

    def counting_open(cls, path, **kw):
        opened.append(str(path))
        return real_open(cls, path, **kw)

    monkeypatch.setattr(ModelFiles, "open", classmethod(counting_open))
    cfg = load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                  f"run.out_dir={tmp_path / 'run'}",
                                                  "actor.kl_coef=0.01"])
    worker, _ = start_worker(cfg, RunPlan.build(cfg))
    assert opened == [str(model)]
    engine = dict(worker.engine.model.named_parameters())
    assert worker.engine.model_path == str(model) and engine
