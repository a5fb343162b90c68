"""The `handoff` command line: plan | train | generate | bench | report | init-model | export.

Each command parses its options and calls one function of the room that does the work;
user errors (HandoffError) print one line and exit 2, never a traceback. What it prints of
the user's (paths, prompts, names) is text, never rich markup: `escape` or `markup=False`.
Keep this package's top-level imports free of torch: `handoff plan` must answer in well
under a second.

This module holds the typer `app` (the console entry point `handoff.cli:app`), the consoles
and what every command shares; one module per command group adds its commands: `plan`,
`train` (train, report), `models` (init-model, generate, export) and `bench` (the bench sub-app).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Callable

import typer
from rich.console import Console
from rich.markup import escape

from handoff.console import table_console
from handoff.errors import HandoffError, host_memory_error

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Colocated RL post-training: the trainer/rollout memory handoff, measured.")
console = table_console()
err_console = Console(stderr=True)
PLAN_DOES_NOT_FIT = 3   # `handoff plan`'s exit status when the verdict is "does not fit"
SILENT_RANK_GRACE_S = 5.0   # a rank that leaves an error to another waits this long first


def friendly_errors(fn: Callable) -> Callable:
    """Turn a HandoffError, or the host's RAM refusing an allocation, into one red line and
    exit code 2 (under torchrun, one rank says an error every rank has alike: _says_error);
    refuse a NaN or infinite number option first (click's FLOAT accepts both, and every
    range check passes NaN)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            check_finite_options(kwargs)
            return fn(*args, **kwargs)
        except (HandoffError, MemoryError, RuntimeError) as e:   # RAM: a model too large
            error = e if isinstance(e, HandoffError) else host_memory_error(e)
            if error is None:
                raise
            if _says_error(error):
                err_console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False,
                                  soft_wrap=True)
            else:
                # torchrun stops every rank once one exits: a rank leaving first could stop
                # the rank that says the error (met a moment later) before it does.
                time.sleep(SILENT_RANK_GRACE_S)
            sys.exit(2)

    return wrapper


def _says_error(error: HandoffError) -> bool:
    """dist.says_error under torchrun's rank variables; a lone process always says its error
    (and imports no torch for it: `handoff plan` answers in well under a second)."""
    if not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & os.environ.keys():
        return True
    from handoff.dist import says_error

    return says_error(error)


def check_finite_options(values: dict) -> None:
    """Raise HandoffError naming the first float option whose value is NaN or infinite."""
    import math

    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise HandoffError(f"--{name.replace('_', '-')} {value} is not a finite number: "
                               "pass a real value (see --help)")


def positive(**options: float) -> None:
    """Refuse a size or count option that is not above 0, naming it."""
    for name, value in options.items():
        if not value > 0:
            raise HandoffError(f"--{name.replace('_', '-')} {value} is not positive: pass a "
                               "value above 0")


def int_list(text: str, flag: str) -> list[int]:
    """A comma-separated option as integers; one line naming `flag` if it is not."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HandoffError(f"{flag} {text!r} is not a comma-separated list of integers: "
                           "write e.g. 1,8,64") from None


def float_list(text: str, flag: str) -> list[float]:
    """A comma-separated option as numbers; one line naming `flag` if it is not."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HandoffError(f"{flag} {text!r} is not a comma-separated list of numbers: "
                           "write e.g. 0.5,0.6,0.7") from None


# The command groups register on `app` as they are imported, so they come after everything
# above that they import; `handoff --help` lists the commands in the order they register.
from handoff.cli import plan, models, bench, train  # noqa: E402,F401


def _reflow_help(typer_app: typer.Typer) -> None:
    """Each command's help is its docstring with the source's line breaks inside a paragraph
    joined (typer keeps them: "random-init of a / preset shape" in `handoff --help`)."""
    import inspect

    for info in typer_app.registered_commands:
        doc = info.help or inspect.getdoc(info.callback) or ""
        info.help = "\n\n".join(" ".join(part.split()) for part in doc.split("\n\n"))
    for group in typer_app.registered_groups:
        _reflow_help(group.typer_instance)


_reflow_help(app)
