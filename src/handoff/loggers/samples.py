"""A few completions per step: out_dir/samples.jsonl, and the same as Markdown for the loggers.

    rows = sample_rows(step, samples, keep=4)     # samples: [(prompt, completion, reward)]
    append_samples(out_dir / "samples.jsonl", rows)
    text = samples_markdown(rows)

Each row is {"step", "prompt", "completion", "reward"}. A resume first drops the rows of the
steps it repeats (`trim_samples`), reading the file as JSON only; a line a crash cut short
ends what is kept.
"""

from __future__ import annotations

import json
from pathlib import Path

from handoff.safe_files import append_line, replace_file

SAMPLES_FILE = "samples.jsonl"


def sample_rows(step: int, samples: list[tuple[str, str, float]], *, keep: int) -> list[dict]:
    """The first `keep` samples of the step (one prompt's group first: its spread shows)."""
    return [{"step": step, "prompt": prompt, "completion": completion, "reward": float(reward)}
            for prompt, completion, reward in samples[:keep]]


def append_samples(path: Path, rows: list[dict]) -> None:
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    append_line(path, path.parent, data)   # whole or not at all, never through a link


def samples_markdown(rows: list[dict]) -> str:
    """The rows as Markdown: a header with the reward, prompt and completion as code blocks
    (model text is shown as written, never rendered)."""
    parts = []
    for i, row in enumerate(rows):
        parts += [f"**sample {i + 1}, reward {row['reward']:.3f}**", "",
                  _code(row["prompt"]), "", _code(row["completion"]), ""]
    return "\n".join(parts)


def _code(text: str) -> str:
    return "    " + text.replace("\n", "\n    ")


def trim_samples(path: Path, first_step: int) -> None:
    """Keep the rows of steps up to `first_step` (a resume repeats the later ones)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            break
        if row["step"] <= first_step:
            kept.append(line + "\n")
    replace_file(path, "".join(kept).encode(), path.parent)   # never through a link
