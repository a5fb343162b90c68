"""model.path as a directory, a preset or a Hub id from the local Hugging Face cache (CPU)."""

from __future__ import annotations

import json
import socket

import pytest

from handoff.errors import HandoffError
from handoff.model_files import check_model_dir
from handoff.model_source import resolve_model
from handoff.modelzoo import init_model
from handoff.plan.shapes import load_shape


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: a Hub id is resolved from the cache alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("the network was asked")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def _hub_cache(root, repo_id: str, revision: str = "0123abcd") -> object:
    """The hub cache's layout: models--org--name/{refs/main, snapshots/<revision>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    init_model("tiny-qwen3", snapshot, dtype="float32")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hub_id_in_the_local_cache_resolves_to_its_snapshot(tmp_path, monkeypatch, no_network):
    snapshot = _hub_cache(tmp_path / "hub", "org/tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    path = resolve_model("org/tiny")
    assert path == str(snapshot)
    check_model_dir(path, flag="model.path")   # a complete checkpoint directory
    # `handoff plan` reads the same snapshot's config.json.
    assert resolve_model("org/tiny", materialise_presets=False) == str(snapshot)


def test_a_hub_id_missing_from_the_cache_names_the_download_command(tmp_path, monkeypatch,
                                                                   no_network):
    _hub_cache(tmp_path / "hub", "org/tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(HandoffError) as e:
        resolve_model("Qwen/Qwen3-0.6B")
    message = str(e.value)
    assert "\n" not in message
    assert "not in the local Hugging Face cache" in message
    assert "`huggingface-cli download Qwen/Qwen3-0.6B`" in message
    assert "`hf download Qwen/Qwen3-0.6B`" in message
    with pytest.raises(HandoffError, match="--model='org/other'"):
        resolve_model("org/other", flag="--model")


def test_a_preset_is_a_random_init_written_once_to_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HANDOFF_CACHE", str(tmp_path / "cache"))
    path = resolve_model("tiny-qwen3")
    assert path == str(tmp_path / "cache" / "tiny-qwen3")
    check_model_dir(path, flag="model.path")
    assert json.loads((tmp_path / "cache" / "tiny-qwen3" / "handoff_preset.json").read_text())[
        "preset"] == "tiny-qwen3"
    assert "random weights (not a pretrained model)" in capsys.readouterr().err
    stamp = (tmp_path / "cache" / "tiny-qwen3" / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny-qwen3") == path   # reused, not written again
    assert (tmp_path / "cache" / "tiny-qwen3" / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny-qwen3"]


def test_plan_keeps_a_preset_name_and_other_paths_pass_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("HANDOFF_CACHE", str(tmp_path / "cache"))
    assert resolve_model("qwen3-32b", materialise_presets=False) == "qwen3-32b"
    assert not (tmp_path / "cache").exists()   # nothing written for a plan
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    # Not Hub ids: left for the model directory's own checks to name.
    for path in ("./models/tiny", ".models/tiny-qwen3", "a/b/c", "/no/such/dir"):
        assert resolve_model(path) == path


def test_the_commands_take_a_cached_hub_id_and_name_a_missing_one(tmp_path, monkeypatch,
                                                                  no_network):
    from typer.testing import CliRunner

    from handoff.cli import app

    _hub_cache(tmp_path / "hub", "org/tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = CliRunner().invoke(app, ["plan", "--model", "org/tiny", "--hardware", "cpu",
                                      "--json"])
    assert result.exit_code in (0, 3), result.output   # planned from the snapshot's config
    assert json.loads(result.stdout)["model"]["params"] == load_shape("tiny-qwen3").num_params
    result = CliRunner().invoke(app, ["generate", "--model", "org/tiny", "--prompt", "hi",
                                      "--max-tokens", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 1
    result = CliRunner().invoke(app, ["generate", "--model", "org/absent", "--prompt", "hi"])
    assert result.exit_code == 2
    assert "`huggingface-cli download org/absent`" in result.output


def test_a_preset_in_a_read_only_or_full_cache_is_one_line_naming_handoff_cache(
        tmp_path, monkeypatch):
    """train and generate write a preset to $HANDOFF_CACHE: a cache they cannot write is
    one line naming it and the fix, and nothing half-written stays there."""
    import errno
    from pathlib import Path

    import transformers.modeling_utils
    from safetensors import SafetensorError
    from typer.testing import CliRunner

    from handoff.cli import app

    cache = tmp_path / "cache"
    monkeypatch.setenv("HANDOFF_CACHE", str(cache))

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    with monkeypatch.context() as patch:
        patch.setattr(Path, "mkdir", read_only)
        result = CliRunner().invoke(app, ["generate", "--model", "tiny-qwen3", "--prompt", "hi"],
                                    terminal_width=400)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"error: the handoff cache {cache} ($HANDOFF_CACHE) is not writable")
    assert "set $HANDOFF_CACHE to a directory you can write to, or point --model at" in line

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(HandoffError, match=r"\$HANDOFF_CACHE\) cannot be written: the disk "
                                           r"is full .*point model.path at"):
        resolve_model("tiny-qwen3")
    assert not cache.exists() or not list(cache.iterdir())


def test_plan_names_a_cached_hub_model_by_its_id_not_its_snapshot(tmp_path, monkeypatch,
                                                                   no_network):
    from typer.testing import CliRunner

    from handoff.cli import app

    _hub_cache(tmp_path / "hub", "org/tiny", revision="abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = CliRunner().invoke(app, ["plan", "--model", "org/tiny", "--hardware", "cpu",
                                      "--json"])
    assert result.exit_code in (0, 3), result.output
    assert json.loads(result.stdout)["model"]["name"] == "org/tiny"
    assert load_shape(str(tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123")
                      ).name == "org/tiny"
