"""README.md's printed excerpts stay true: each `handoff` command followed by "(excerpt)" prints
every line the README shows for it."""

import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from handoff.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"
EXCERPT = re.compile(r"```bash\n(handoff [^\n]+)\n```\s*\n[^\n]*\(excerpt\):\s*\n\s*```text\n"
                     r"(.*?)\n```", re.S)


def test_every_readme_excerpt_is_in_its_commands_output():
    found = EXCERPT.findall(README.read_text())
    assert found   # a README the pattern no longer parses must not pass
    for command, excerpt in found:
        result = CliRunner().invoke(app, shlex.split(command)[1:], terminal_width=400)
        printed = {line.strip() for line in result.output.splitlines()}
        missing = [line for line in excerpt.splitlines() if line.strip() not in printed]
        assert not missing, (command, missing)
