"""docs/BAD_INPUTS.md stays true: every row names a test that exists."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\|(?P<input>[^|]+)\|(?P<gets>[^|]+)\|\s*`(?P<test>[^`]+)`\s*\|$")


def _rows() -> list[dict]:
    text = (ROOT / "docs" / "BAD_INPUTS.md").read_text()
    return [m.groupdict() for line in text.splitlines() if (m := ROW.match(line.strip()))]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and node.name.startswith("test_")}


def test_every_row_names_a_test_that_exists():
    rows = _rows()
    assert len(rows) >= 40   # a table the pattern no longer parses must not pass
    missing = []
    for row in rows:
        file, _, name = row["test"].partition("::")
        path = ROOT / file
        if not path.is_file() or name not in _test_names(path):
            missing.append(row["test"])
    assert not missing, missing


def test_every_hardening_test_file_is_in_the_table():
    named = {row["test"].partition("::")[0] for row in _rows()}
    for file in ("tests/test_config_finite.py", "tests/test_cli_numbers.py",
                 "tests/test_run_dir.py", "tests/test_model_files.py",
                 "tests/trainer/test_checkpoint_files.py", "tests/plan/test_plan_does_not_fit.py",
                 "tests/test_model_sources.py", "tests/test_reading.py",
                 "tests/test_start_checks.py", "tests/test_launch_env.py",
                 "tests/test_safe_files.py", "tests/trainer/test_checkpoint_edges.py",
                 "tests/trainer/test_checkpoint_pythons.py", "tests/test_crash_resume.py"):
        assert file in named, file
