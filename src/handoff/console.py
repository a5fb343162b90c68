"""The console the tables print to (`handoff plan`, a run's summary, `handoff report`)."""

from __future__ import annotations

import os
import sys

from rich.console import Console

PIPE_WIDTH = 160   # the widest table (plan's switch actions with their notes) fits whole


def table_console() -> Console:
    """stdout at the terminal's width; into a pipe or a file (no terminal, no COLUMNS) at
    PIPE_WIDTH columns, where rich's 80 would crop a table's last columns to a few letters."""
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=PIPE_WIDTH if piped else None)
