"""`handoff train` (the colocated GRPO run) and `handoff report` (a finished run's record)."""

from __future__ import annotations

import signal
import sys
from typing import Optional

import typer
from rich.markup import escape

from handoff.cli import app, err_console, friendly_errors


@app.command("train", context_settings={"allow_extra_args": False})
@friendly_errors
def train_cmd(
    config: str = typer.Argument(..., help="YAML config, e.g. examples/cpu-demo.yaml"),
    overrides: Optional[list[str]] = typer.Argument(None, help="overrides key.sub=value"),
    resume: bool = typer.Option(False, "--resume", help="continue from the last checkpoint"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the earlier run in "
                                   "run.out_dir (refused without it or --resume)"),
) -> None:
    """Colocated sync GRPO: generate, switch, train, switch back; planned vs measured at the end."""
    from handoff.api import train
    from handoff.config import load_config
    from handoff.dist import end_distributed_run, world_rank_size
    from handoff.run_dir import interrupted_message, resume_command

    cfg = load_config(config, list(overrides or []) + (["run.resume=true"] if resume else [])
                      + (["run.overwrite=true"] if overwrite else []))
    stopped_by = [signal.SIGINT]

    def terminated(signum, frame):
        # `timeout`, SLURM's time limit, `docker stop`: the same wind-up as Ctrl-C
        stopped_by[0] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    try:
        train(cfg)
    except KeyboardInterrupt:
        # A second Ctrl-C (or SIGTERM) while the line is made would be a traceback over it:
        # ignored then; after it, one ends the process at once (an exit stuck in a thread's
        # join or a peer's collective stays killable), no traceback either way.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if world_rank_size()[0] == 0:   # the command as given: its overrides, markup as text
            said = interrupted_message(cfg, resume_command(config, list(overrides or [])))
            err_console.print(f"[bold yellow]{escape(said)}[/]", highlight=False, soft_wrap=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        sys.exit(128 + stopped_by[0])   # 130 for SIGINT, 143 for SIGTERM, as the shell says
    # Not after an error: the other ranks may sit in a collective.
    end_distributed_run()


@app.command("report")
@friendly_errors
def report_cmd(run_dir: str = typer.Argument(..., help="run.out_dir of a `handoff train` run")) -> None:
    """Per-step metrics and planned vs measured switch actions of a finished run."""
    from handoff.run_report import show_run

    show_run(run_dir)


@app.command("config")
@friendly_errors
def config_cmd(
    markdown: bool = typer.Option(False, "--markdown", help="a Markdown table"),
) -> None:
    """Every config key with its default, accepted values and help (override any as
    section.key=value)."""
    from handoff.config import reference

    rows = reference()
    if markdown:
        print("| key | default | accepted | help |\n|---|---|---|---|")
        for r in rows:   # a cell's own "|" (true | false | auto) would split the row
            cells = [f"`{r['key']}`", f"`{r['default']}`", r["range"], r["help"]]
            print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return
    for r in rows:
        accepted = f"  [{r['range']}]" if r["range"] else ""
        print(f"{r['key']} = {r['default']}{accepted}\n    {r['help']}")
