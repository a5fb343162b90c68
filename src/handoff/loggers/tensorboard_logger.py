"""TensorBoard: out_dir/tensorboard, a scalar per metric, the config and samples as text."""

from __future__ import annotations

import json
from pathlib import Path

from handoff.loggers.base import numeric_items
from handoff.safe_files import make_dirs


class TensorBoardLogger:
    def __init__(self, out_dir: Path, *, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # Events of steps after first_step (an earlier run's, or a crashed step's that a
        # resume repeats) are purged, as the trimmed metrics.jsonl drops their rows.
        make_dirs(out_dir / "tensorboard", out_dir)   # a linked tensorboard/ is refused
        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=first_step + 1)
        self.first_step = first_step

    def log_config(self, config: dict) -> None:
        if self.first_step == 0:   # a resume's config is the run's own: written once
            text = json.dumps(config, indent=1)
            self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)

    def log_metrics(self, row: dict, step: int) -> None:
        for key, value in numeric_items(row).items():
            self.writer.add_scalar(key, value, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()
