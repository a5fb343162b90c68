"""What handoff prints is text, not rich markup: a path, a prompt or a file's name holding
`[`, `]` is printed as given, never styled or swallowed."""

import io
import json

import pytest
from rich.console import Console

from handoff import run_dir, run_report

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
    assert f"{out / 'summary.json'} is damaged" in text


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
