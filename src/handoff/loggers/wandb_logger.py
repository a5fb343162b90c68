"""Weights & Biases (`pip install 'handoff[wandb]'`): a run under out_dir/wandb.

With WANDB_MODE=offline nothing leaves the machine (`wandb sync out_dir/wandb/offline-run-*`
uploads it later); online it needs `wandb login`. The project is run.wandb_project (default
'handoff'), the run is named after out_dir; WANDB_* environment variables apply as usual.
"""

from __future__ import annotations

from pathlib import Path

from handoff.errors import HandoffError
from handoff.loggers.base import missing_package, numeric_items


class WandbLogger:
    def __init__(self, out_dir: Path, *, project: str | None):
        try:
            import wandb
        except ImportError:
            raise missing_package("wandb", "wandb") from None
        try:
            # console="off": wandb would otherwise wrap stdout, where the progress bar lives.
            self.run = wandb.init(project=project or "handoff", name=out_dir.resolve().name,
                                  dir=str(out_dir),
                                  settings=wandb.Settings(console="off"))
        except wandb.errors.Error as e:
            raise HandoffError(f"wandb could not start a run ({e}): run `wandb login`, or set "
                               "WANDB_MODE=offline to keep it in out_dir/wandb and `wandb sync` "
                               "it later") from None

    def log_config(self, config: dict) -> None:
        self.run.config.update(config)

    def log_metrics(self, row: dict, step: int) -> None:
        self.run.log(numeric_items(row), step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: text}, step=step)

    def close(self) -> None:
        self.run.finish()
