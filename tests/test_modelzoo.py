"""handoff init-model: what it refuses before building anything."""

import json


def test_init_model_refuses_a_preset_larger_than_host_ram(tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app

    result = CliRunner().invoke(app, ["init-model", "--preset", "deepseek-v3", "--out",
                                      str(tmp_path / "m")])
    assert result.exit_code == 2
    assert "needs" in result.output and "host RAM" in result.output
    assert not (tmp_path / "m").exists()


def test_init_model_refuses_a_dangling_link_as_out(tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app

    (tmp_path / "m").symlink_to(tmp_path / "nowhere")
    result = CliRunner().invoke(app, ["init-model", "--preset", "tiny-qwen3", "--out",
                                      str(tmp_path / "m")], terminal_width=300)
    assert result.exit_code == 2 and "symbolic link to nothing" in result.output
    assert not (tmp_path / "nowhere").exists()


def test_init_model_overwrite_refuses_a_run_directory(tmp_path):
    """A run's config.json would become the model's (the run could no longer be exported or
    resumed): refused with --overwrite too, nothing written (a tester's find)."""
    from typer.testing import CliRunner

    from handoff.cli import app
    from handoff.config import load_config, to_dict

    run = tmp_path / "run"
    run.mkdir()
    record = to_dict(load_config("examples/cpu-demo.yaml", []))
    (run / "config.json").write_text(json.dumps(record))
    (run / "metrics.jsonl").write_text("{}\n")
    kept = {p.name: p.read_bytes() for p in run.iterdir()}
    for preset in ("tiny-qwen3", "smollm2-135m-instruct"):   # the demo's is converted
        result = CliRunner().invoke(app, ["init-model", "--preset", preset, "--out", str(run),
                                          "--overwrite"], terminal_width=300)
        assert result.exit_code == 2 and "holds a handoff run" in result.output, result.output
        assert {p.name: p.read_bytes() for p in run.iterdir()} == kept


def _error_line(result) -> str:
    """The one error line (transformers' own progress bar for the weights may come before)."""
    lines = [line for line in result.output.splitlines() if line.strip()
             and not line.startswith("Writing model shards")]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), \
        result.output
    return lines[0]


def test_init_model_overwrite_replaces_links_and_never_writes_their_targets(tmp_path):
    """--overwrite over links planted at its file names (pointing outside --out): the links
    are replaced by the model's files, their targets keep their bytes."""
    from typer.testing import CliRunner

    from handoff.cli import app
    from handoff.model_files import check_model_dir

    out = tmp_path / "m"
    out.mkdir()
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "handoff_preset.json", "model.safetensors"]
    for name in names:
        (tmp_path / f"victim_{name}").write_text("victim")
        (out / name).symlink_to(tmp_path / f"victim_{name}")
    result = CliRunner().invoke(app, ["init-model", "--preset", "tiny-qwen3", "--out", str(out),
                                      "--overwrite", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert [(tmp_path / f"victim_{n}").read_text() for n in names] == ["victim"] * len(names)
    assert not any((out / n).is_symlink() for n in names)
    check_model_dir(str(out), flag="--out")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "m") == \
        sorted(f"victim_{n}" for n in names)   # no staging left beside or inside
    assert not list(out.glob(".handoff-init-*"))


def test_init_model_to_a_read_only_or_full_out_is_one_line_and_leaves_nothing(tmp_path,
                                                                              monkeypatch):
    import errno
    from pathlib import Path

    import transformers.modeling_utils
    from safetensors import SafetensorError
    from typer.testing import CliRunner

    from handoff.cli import app

    out = tmp_path / "new" / "m"
    args = ["init-model", "--preset", "tiny-qwen3", "--out", str(out), "--dtype", "float32"]

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    with monkeypatch.context() as patch:
        patch.setattr(Path, "mkdir", read_only)
        line = _error_line(CliRunner().invoke(app, args, terminal_width=400))
    assert f"--out '{out}' is not writable" in line and "Read-only file system" in line
    assert line.endswith("pass a directory you can write to")

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    line = _error_line(CliRunner().invoke(app, args, terminal_width=400))
    assert f"--out '{out}' cannot be written: the disk is full" in line
    assert "free space there, or pass a directory you can write to" in line
    assert not (tmp_path / "new").exists()   # what it made is removed
