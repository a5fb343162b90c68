"""Where a run's metrics go beside metrics.jsonl (run.loggers), and its sample completions.

    loggers = open_loggers(cfg, out_dir, first_step=0)   # rank 0, after out_dir is claimed
    loggers.log_config(to_dict(cfg))
    loggers.log_metrics(row, row["step"])
    loggers.log_samples(step, [(prompt, completion, reward), ...])
    loggers.close()

tensorboard (torch's SummaryWriter, out_dir/tensorboard), wandb (out_dir/wandb) and mlflow
(out_dir/mlruns) each implement base.Logger. wandb and mlflow are optional extras: naming one
whose package is missing is refused before the run starts (check_loggers, preflight) with the
pip command; TensorBoard, part of the runtime extra, only warns (metrics.jsonl has it all).
A resume continues TensorBoard's events (the repeated steps purged) and samples.jsonl (their
rows dropped); in wandb and MLflow it is a new run that starts at the resumed step.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from rich.console import Console

from handoff.config import Config
from handoff.loggers.base import Logger, missing_package
from handoff.loggers.samples import (SAMPLES_FILE, append_samples, sample_rows,
                                     samples_markdown, trim_samples)

# mlflow's usage telemetry writes ~/.config/mlflow/ (a run writes in its out_dir only); set
# before any mlflow import of the run (a reward module's too), which starts the telemetry,
# and only where the user left it unset.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}

console = Console(stderr=True)


def check_loggers(names: list[str]) -> None:
    """Refuse an optional logger whose package is not installed (one line: the pip command)."""
    for name in names:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            raise missing_package(name, PACKAGES[name][1])


class Loggers:
    """Every logger of run.loggers, and samples.jsonl, behind the calls of base.Logger."""

    def __init__(self, loggers: list[Logger], out_dir: Path, *, samples_per_step: int):
        self.loggers = loggers
        self.samples_path = out_dir / SAMPLES_FILE
        self.samples_per_step = samples_per_step

    def log_config(self, config: dict) -> None:
        for logger in self.loggers:
            logger.log_config(config)

    def log_metrics(self, row: dict, step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(row, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        for logger in self.loggers:
            logger.log_text(tag, text, step)

    def log_samples(self, step: int, samples: list[tuple[str, str, float]]) -> None:
        """The first run.log_samples (prompt, completion, reward) of step `step` (counted from
        1, as metrics rows are): appended to samples.jsonl and logged as text 'samples'."""
        rows = sample_rows(step, samples, keep=self.samples_per_step)
        if rows:
            append_samples(self.samples_path, rows)
            self.log_text("samples", samples_markdown(rows), step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def open_loggers(cfg: Config, out_dir: Path, *, first_step: int) -> Loggers:
    """The loggers of cfg.run.loggers for a run that starts (or resumes) at `first_step`;
    samples.jsonl keeps the rows of the steps before it."""
    check_loggers(cfg.run.loggers)
    trim_samples(out_dir / SAMPLES_FILE, first_step)
    loggers: list[Logger] = []
    try:
        for name in dict.fromkeys(cfg.run.loggers):   # each once, in the order given
            _open(name, cfg, out_dir, first_step, loggers)
    except BaseException:
        for logger in loggers:   # the ones already open end cleanly
            logger.close()
        raise
    return Loggers(loggers, out_dir, samples_per_step=cfg.run.log_samples)


def _open(name: str, cfg: Config, out_dir: Path, first_step: int, into: list[Logger]) -> None:
    if name == "tensorboard":
        try:
            from handoff.loggers.tensorboard_logger import TensorBoardLogger

            into.append(TensorBoardLogger(out_dir, first_step=first_step))
        except ImportError:   # metrics.jsonl has everything
            console.print("[yellow]tensorboard is not installed: no TensorBoard events "
                          "(pip install 'handoff[runtime]')[/]", highlight=False)
    elif name == "wandb":
        from handoff.loggers.wandb_logger import WandbLogger

        into.append(WandbLogger(out_dir, project=cfg.run.wandb_project))
    else:
        from handoff.loggers.mlflow_logger import MlflowLogger

        into.append(MlflowLogger(out_dir))
