"""`handoff config`: every key of the config tree, generated from config.py's own fields."""

import dataclasses

from typer.testing import CliRunner

from handoff.cli import app
from handoff.config import Config, reference


def _keys(obj, prefix=""):
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out += (_keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value)
                else [f"{prefix}{f.name}"])
    return out


def test_every_key_is_listed_with_its_default_and_help():
    rows = reference()
    assert [r["key"] for r in rows] == _keys(Config())
    assert all(r["help"] for r in rows)
    by_key = {r["key"]: r for r in rows}
    assert by_key["run.steps"]["default"] == "10" and by_key["run.steps"]["range"] == "[1, 10000000]"
    assert "token_mean" in by_key["actor.loss_agg"]["range"]


def test_the_command_prints_the_listing_and_a_markdown_table():
    result = CliRunner().invoke(app, ["config"])
    assert result.exit_code == 0 and "reward.functions = []" in result.output
    table = CliRunner().invoke(app, ["config", "--markdown"]).output.splitlines()
    assert table[0].startswith("| key |") and len(table) == 2 + len(reference())


def test_a_boolean_that_takes_auto_lists_all_three_words():
    by_key = {r["key"]: r["range"] for r in reference()}
    assert by_key["actor.gradient_checkpointing"] == "true | false | auto"
    assert by_key["actor.compile"] == "true | false | auto"
    assert by_key["actor.micro_batch_tokens"] == "[0, inf) or auto"


def test_the_markdown_table_keeps_four_cells_a_row_whatever_a_cell_holds():
    """Accepted values such as `true | false | auto` are one cell: their bars escaped."""
    import re

    lines = CliRunner().invoke(app, ["config", "--markdown"]).output.splitlines()
    rows = [line for line in lines[2:] if line.startswith("| `")]
    assert len(rows) == len(reference())
    for row in rows:
        cells = re.split(r"(?<!\\)\|", row.strip())[1:-1]   # unescaped bars only
        assert len(cells) == 4, row
