"""What every logger does, and the one line a logger whose package is missing gets."""

from __future__ import annotations

from typing import Protocol

from handoff.errors import HandoffError


class Logger(Protocol):
    """One destination of a run's metrics beside metrics.jsonl (rank 0 only)."""

    def log_config(self, config: dict) -> None:
        """The run's whole config (config.to_dict), once at the start."""

    def log_metrics(self, row: dict, step: int) -> None:
        """A step's metrics row: its numeric values, keyed as in metrics.jsonl."""

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Markdown text under `tag` at `step` (sample completions)."""

    def close(self) -> None:
        """Flush and end the run."""


def numeric_items(row: dict) -> dict[str, float]:
    """The row's numbers a logger plots: every int or float but the step itself."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


def missing_package(logger: str, package: str) -> HandoffError:
    return HandoffError(f"run.loggers names {logger} but {package} is not installed: "
                        f"pip install 'handoff[{logger}]', or drop {logger} from run.loggers")
