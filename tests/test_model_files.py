"""A model directory a user got wrong: truncated, missing or mis-shaped weights, no tokenizer,
a context the model does not have; and `init-model --out` over something already there."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from handoff.cli import app
from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.model_files import check_model_dir
from handoff.preflight import preflight

runner = CliRunner()


def _one_error_line(res) -> str:
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and lines and lines[-1].startswith("error:"), res.output
    assert "Traceback" not in res.output
    return lines[-1]


def _train(model, out, *extra):
    return runner.invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model}",
                               f"run.out_dir={out}", *extra], terminal_width=400)


def test_truncated_or_missing_weights_are_named_before_loading(model, tmp_path):
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    line = _one_error_line(_train(model, tmp_path / "run"))
    assert f"{weights} is truncated: its header describes" in line
    weights.write_bytes(b"\x00\x01")
    assert "is truncated or not a safetensors file" in _one_error_line(
        _train(model, tmp_path / "run"))
    weights.unlink()
    assert "has no *.safetensors weights" in _one_error_line(_train(model, tmp_path / "run"))
    assert not (tmp_path / "run").exists()   # refused before anything was written


def test_a_dangling_weights_link_is_named_as_one(model, tmp_path):
    """An HF cache snapshot whose blob was deleted: a link to nothing, not a wrong name."""
    weights = model / "model.safetensors"
    weights.unlink()
    weights.symlink_to(tmp_path / "blobs" / "gone")
    line = _one_error_line(_train(model, tmp_path / "run"))
    assert f"{weights} is a symbolic link to a missing file ({tmp_path / 'blobs' / 'gone'})" \
        in line and line.endswith("re-download or copy the weights")
    assert not (tmp_path / "run").exists()


def test_a_tensor_of_the_wrong_shape_or_none_is_refused_by_the_trainer(model):
    from handoff.config import ActorConfig
    from handoff.trainer.actor import Actor

    weights = model / "model.safetensors"
    state = load_file(str(weights))
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(state, str(weights), metadata={"format": "pt"})
    check_model_dir(model)   # complete: only the model knows the shape is wrong
    with pytest.raises(HandoffError, match=r"tensor model.layers.0.mlp.up_proj.weight has "
                                           r"shape \(100, 64\), its config.json makes it "
                                           r"\(128, 64\)"):
        Actor(str(model), actor=ActorConfig(), dtype="float32")
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(HandoffError, match="lacks tensor model.layers.0.mlp.up_proj.weight"):
        Actor(str(model), actor=ActorConfig(), dtype="float32")


def test_generate_without_tokenizer_files_says_so(model):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    line = _one_error_line(runner.invoke(app, ["generate", "--model", str(model), "--prompt",
                                               "hi"], terminal_width=400))
    assert "has no tokenizer files" in line and "prompt 0 is empty" not in line


def test_max_model_len_past_the_models_positions_is_capped_with_a_warning(good, tmp_path,
                                                                         capsys):
    cfg = load_config("examples/cpu-tiny.yaml", [f"model.path={good}",
                                                 f"run.out_dir={tmp_path}",
                                                 "rollout.max_model_len=100000"])
    preflight(cfg)
    assert cfg.rollout.max_model_len == 512   # tiny-qwen3's max_position_embeddings
    assert "rollout.max_model_len=100000 is above the model's max_position_embeddings=512: " \
           "capped at 512" in " ".join(capsys.readouterr().err.split())
    too_long = load_config("examples/cpu-tiny.yaml", [f"model.path={good}",
                                                      f"run.out_dir={tmp_path}",
                                                      "rollout.max_model_len=100000",
                                                      "rollout.max_tokens=600"])
    with pytest.raises(HandoffError, match="max_tokens=600 leaves no room for a prompt in the "
                                           "model's 512 positions"):
        preflight(too_long)


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}


def test_init_model_over_an_existing_model_or_a_file_is_refused(model, tmp_path):
    before = _digest(model)
    line = _one_error_line(runner.invoke(app, ["init-model", "--preset", "tiny-llama", "--out",
                                               str(model)], terminal_width=400))
    assert "already holds files" in line and "--overwrite" in line
    assert _digest(model) == before
    line = _one_error_line(runner.invoke(app, ["init-model", "--preset", "tiny-qwen3", "--out",
                                               str(model / "config.json")], terminal_width=400))
    assert "is a file, not a directory" in line
    res = runner.invoke(app, ["init-model", "--preset", "tiny-llama", "--out", str(model),
                              "--overwrite"])
    assert res.exit_code == 0, res.output
    assert '"model_type": "llama"' in (model / "config.json").read_text()


def test_a_peft_adapter_directory_given_as_the_model_is_named_as_one(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"base_model_name_or_path": "base"}')
    with pytest.raises(HandoffError, match=r"is a PEFT adapter directory, not a model: point it "
                                           r"at the adapter's base model"):
        check_model_dir(tmp_path, flag="model.path")


def test_a_run_directory_given_as_the_model_points_at_export(tmp_path):
    from handoff.config import Config, to_dict

    (tmp_path / "config.json").write_text(json.dumps(to_dict(Config())))   # a run's config
    with pytest.raises(HandoffError, match=r"is a handoff run directory, not a model: "
                                           r"`handoff export .* --out DIR` writes its model"):
        check_model_dir(tmp_path, flag="model.path")
