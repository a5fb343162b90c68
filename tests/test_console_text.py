"""What handoff prints is text, not rich markup: a path, a prompt or a file's name holding
`[`, `]` is printed as given, never styled or swallowed."""

import io
import json

import pytest
from rich.console import Console

from handoff import run_dir, run_report
from wrapped_text import flat

# Names rich would read as markup (a style, a closing tag, a link) or as an escape.
MARKUP_NAMES = ["run[red]x", "[bold]out", "x[link=https:]y", "[i]", "q\\[z]", "[yellow"]



@pytest.fixture()
def printed(monkeypatch):
    """Everything run_report and run_dir print, as plain text."""
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None)
    monkeypatch.setattr(run_report, "console", console)
    monkeypatch.setattr(run_dir, "console", console)
    return out


def _metrics(directory, rows, tail=""):
    directory.mkdir()
    (directory / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + tail)


def _row(step, kl=0.0):
    return {"step": step, "reward_mean": 0.5, "response_length": 3.0, "kl": kl,
            "timing_s/gen": 1.0, "timing_s/step": 2.0}


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_report_prints_a_run_dir_with_brackets_as_given(tmp_path, printed, name):
    out = tmp_path / name
    _metrics(out, [_row(1)], tail="{cut short\n")
    (out / "summary.json").write_text("[not a summary")
    run_report.show_run(out)
    text = printed.getvalue()
    assert f"{out / 'metrics.jsonl'} line 2 is not a complete metrics row" in text
    # The table's title wraps to the table's width: compare without the white space.
    assert "".join(f"{out}: 1 steps".split()) in "".join(text.split())
    assert f"{out / 'summary.json'} is not valid JSON" in text   # the path as given


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_a_resume_prints_a_damaged_metrics_path_as_given(tmp_path, printed, name):
    out = tmp_path / name
    _metrics(out, [_row(1), _row(2)], tail="{cut short\n")
    run_dir.trim_metrics(out, 1)
    text = printed.getvalue()
    assert f"{out / 'metrics.jsonl'} line 3" in text and "dropping 1 metrics row" in text


def test_report_shows_kl_only_for_a_run_with_a_reference(tmp_path, printed):
    _metrics(tmp_path / "none", [_row(1), _row(2)])
    run_report.show_run(tmp_path / "none")
    assert " kl " not in printed.getvalue() and "0.0000" not in printed.getvalue()
    _metrics(tmp_path / "ref", [_row(1, kl=0.0), _row(2, kl=0.0125)])
    run_report.show_run(tmp_path / "ref")
    assert " kl " in printed.getvalue() and "0.0125" in printed.getvalue()


# ---------------------------------------------------------------- the command line

def _cli(*args):
    from typer.testing import CliRunner

    from handoff.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_an_error_naming_a_path_with_brackets_prints_it_as_given(tmp_path, name):
    res = _cli("report", str(tmp_path / name))
    assert res.exit_code == 2
    assert flat(f"error: {tmp_path / name} holds no metrics.jsonl") in flat(res.output)


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_plan_prints_a_model_directory_with_brackets_as_given(tmp_path, name):
    from handoff.plan.shapes import PRESETS

    model = tmp_path / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"]))
    res = _cli("plan", "--model", str(model), "--gpus", "1")
    assert res.exit_code in (0, 3) and f"model {name}: " in res.output


def test_generate_prints_prompts_and_samples_with_brackets_as_given(monkeypatch):
    from handoff.rollout import cli_generate

    def fake_samples(model, prompts, **kwargs):
        return [{"prompt": p, "text": f"[green]{p}", "token_ids": [1, 2],
                 "finish_reason": "stop"} for p in prompts]

    monkeypatch.setattr(cli_generate, "generate_samples", fake_samples)
    monkeypatch.setattr(cli_generate, "is_main_process", lambda: True)
    res = _cli("generate", "--model", "m", "--prompt", "[red]2+2=[/]", "--prompt", "[b]x")
    assert res.exit_code == 0, res.output
    assert "'[red]2+2=[/]' -> '[green][red]2+2=[/]' (2 tokens, stop)" in res.output
    assert "'[b]x' -> '[green][b]x'" in res.output


def test_init_model_prints_its_directory_as_given(tmp_path, monkeypatch):
    from handoff import modelzoo

    monkeypatch.setattr(modelzoo, "init_model", lambda preset, out, **kw: out)
    res = _cli("init-model", "--preset", "tiny-qwen3", "--out", str(tmp_path / "[red]m"))
    assert res.exit_code == 0 and flat(f"to {tmp_path / '[red]m'}") in flat(res.output)


@pytest.mark.parametrize("prompt, refused", [("\udcff", True), ("ok", False),
                                             ("a\ud800b", True), ("\udfff tail", True)])
def test_a_prompt_that_is_not_utf8_text_is_refused_in_one_line(tmp_path, prompt, refused):
    from handoff.errors import HandoffError
    from handoff.rollout.cli_generate import check_prompts

    if not refused:
        check_prompts(["fine", prompt])
        return
    with pytest.raises(HandoffError, match="prompt 1 is not valid UTF-8 text") as e:
        check_prompts(["fine", prompt])
    assert "\n" not in str(e.value)
    # Through the command: refused before the model directory is looked at.
    res = _cli("generate", "--model", str(tmp_path / "none"), "--prompt", prompt)
    assert res.exit_code == 2 and "prompt 0 is not valid UTF-8 text" in res.output
    assert "Traceback" not in res.output


def test_invalid_utf8_bytes_in_a_real_argument_are_refused(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "handoff", "generate", "--model",
                          str(tmp_path), "--prompt", b"caf\xe9 \xff"], capture_output=True)
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode == 2 and "prompt 0 is not valid UTF-8 text" in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"]])
def test_the_command_lists_show_each_help_paragraph_on_one_line(args):
    """typer keeps a docstring's line breaks; the command lists join them (a wide terminal
    shows each command's first paragraph whole on its line)."""
    import inspect

    from typer.testing import CliRunner

    from handoff.cli import app

    typer_app = app if args == ["--help"] else app.registered_groups[0].typer_instance
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "400"}).output
    lines = [line.strip(" │") for line in shown.splitlines()]
    for info in typer_app.registered_commands:
        first = " ".join(inspect.getdoc(info.callback).split("\n\n")[0].split())
        assert any(line.endswith(first) for line in lines), (info.name, first)


def test_tables_into_a_pipe_are_printed_whole():
    """Into a pipe rich takes 80 columns and crops a wide table's last columns to a few
    letters; the tables' console is PIPE_WIDTH wide there (no terminal, no COLUMNS)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "handoff", "plan", "--model", "qwen3-4b",
                          "--hardware", "h200"], capture_output=True, text=True, env=env,
                         timeout=120).stdout
    rows = [line for line in out.splitlines() if line.startswith("│ 1 │ optimizer_d2h")]
    assert rows and rows[0].rstrip().endswith("│"), out
    assert "fp32 master + Adam" in rows[0]
