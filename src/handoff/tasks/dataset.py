"""User data: prompts and reference answers from a JSONL or Parquet file (`data.task=file`),
a `datasets` save_to_disk directory or a cached Hub dataset id (saved_datasets.py).

    {"prompt": "What is the capital of France?", "answer": "Paris"}
    {"prompt": "What is 6 x 7?", "answer": 42}

The field names are `data.prompt_field` / `data.answer_field` (a dotted name reads a nested
field: `reward_model.ground_truth` for verl's parquet files). A prompt is a string (the
user turn) or a list of chat messages ({"role", "content"}). Every other field of a record
reaches the rewards: `Problem.metadata["columns"]` (handoff/rewards). Answers that read as a number
are graded numerically (see answers.py: `#### N`, `\\boxed{N}`, or the last number);
others by normalised exact match of the marked answer or the last line. An answer written as
a number the grader cannot read (`inf`, `NaN`, `1e999`, a power, more than 64 digits) is
refused at start, naming the record. Records are visited in a fresh seeded permutation each
epoch; record order on disk does not matter.
"""

from __future__ import annotations

import codecs
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from handoff.errors import HandoffError
from handoff.tasks.answers import (
    MAX_DIGITS, MAX_EXPONENT, UnreadableNumber, normalize_number, read_number, score_numeric,
    score_text,
)
from handoff.tasks.base import Problem, Score, Task, encode_prompt
from handoff.tasks.saved_datasets import load_dataset_rows, looks_like_hub_id

SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")
# A missing data.path ending in one of these is a file name, never a Hub dataset id.
FILE_SUFFIXES = (*SUFFIXES, ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".xlsx")


def _read_json_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    # A byte-order mark (Windows editors) is no record; offsets below are the file's.
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = skip + e.start
        line = data.count(b"\n", 0, at) + 1
        raise HandoffError(f"{path}:{line} is not UTF-8 (byte 0x{data[at]:02x} at offset "
                           f"{at}): re-save the file as UTF-8") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise HandoffError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): "
                               "fix the file or write one JSON object per line") from None
        lines = [None] * len(rows)   # one document: records, not lines
    else:
        rows, lines = [], []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            lines.append(lineno)
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise HandoffError(f"{path}:{lineno} is not valid JSON ({e.msg}): fix or "
                                   "remove that line (one JSON object per line)") from None
            except ValueError as e:  # an integer of more digits than Python converts
                raise HandoffError(f"{path}:{lineno} holds a number Python will not read "
                                   f"({e}): write it as a string or fix that line") from None
    for i, (row, lineno) in enumerate(zip(rows, lines)):
        if not isinstance(row, dict):
            at = f"record {i} of {path}" if lineno is None else f"{path}:{lineno}"
            raise HandoffError(f"{at} is a {type(row).__name__}, not an object: "
                               'write one {"prompt": ..., "answer": ...} object per record')
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise HandoffError(f"reading {path} needs pyarrow: pip install pyarrow "
                           "(or convert the file to JSONL)") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise HandoffError(f"{path} is not a readable Parquet file ({e}): check or "
                           "re-export it") from None


def load_records(path: str | Path, *, split: str = "train",
                 subset: str | None = None, flag: str = "data.path") -> list[dict]:
    """Every record of a JSONL / JSON / Parquet file, a save_to_disk directory or a cached Hub
    dataset (`split`, `subset`), as dicts; HandoffError if none."""
    p = Path(path)
    if p.is_dir() or (not p.exists() and p.suffix.lower() not in FILE_SUFFIXES
                      and looks_like_hub_id(str(path))):
        rows = load_dataset_rows(path, split=split, subset=subset)
        if not rows:
            raise HandoffError(f"dataset {str(path)!r} (split {split!r}) holds no records: "
                               "pick another data.split or add rows")
        return rows
    if not p.is_file():
        unread = ("" if p.suffix.lower() in SUFFIXES else
                  f" ({p.suffix} is not read: use one of {', '.join(SUFFIXES)})")
        raise HandoffError(f"data file {str(p)!r} not found: set {flag} to an existing "
                           f"JSONL or Parquet file{unread}")
    if p.suffix.lower() not in SUFFIXES:
        raise HandoffError(f"data file {str(p)!r} has an unsupported extension: use one of "
                           f"{', '.join(SUFFIXES)}")
    parquet = p.suffix.lower() in (".parquet", ".pq")
    rows = _read_parquet(p) if parquet else _read_json_lines(p)
    if not rows:
        raise HandoffError(f"data file {str(p)!r} holds no records: add at least one row with "
                           "a prompt field and an answer field")
    return rows


def unreadable_answer(path: Path, row: int, raw: str) -> HandoffError:
    """The one line for a record whose answer is a number no grader can compare."""
    return HandoffError(f"record {row} of {path}: answer {raw[:60]!r} is not a finite number "
                        f"the grader reads (inf, nan, a power, over {MAX_DIGITS} digits or an "
                        f"exponent beyond {MAX_EXPONENT}): write the number out, or fix the "
                        "record")


def _field(row: dict, key: str) -> Any:
    """row[key], or a nested field by a dotted name (reward_model.ground_truth); None if absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _check_field(rows: list[dict], path: Path, key: str, setting: str) -> None:
    for i, row in enumerate(rows):
        if key in row and row[key] is None:
            raise HandoffError(f"record {i} of {path}: its {key!r} is null: give it a value or "
                               "remove the record")
        if _field(row, key) is None:
            fields = ", ".join(sorted(row)) or "none"
            where = f"{path}" if i == 0 else f"record {i} of {path}"
            raise HandoffError(f"{setting}={key!r} is not a field of {where} (its fields: "
                               f"{fields}): set {setting} to one of them or fix the record")


def _messages(prompt: Any, row: int, path: Path) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise HandoffError(f"record {row} of {path}: the prompt is neither a string nor a list of "
                       '{"role", "content"} messages: fix that record')


class DatasetTask(Task):
    """Problems from a user file; numeric answers graded numerically, others by exact match."""

    name = "file"
    instruction: str | None = None  # appended to the last user turn of every prompt

    def __init__(self, path: str | Path, *, prompt_field: str = "prompt",
                 answer_field: str | None = "answer", seed: int = 0, split: str = "train",
                 subset: str | None = None, shuffle: bool = True,
                 flag: str = "data.path") -> None:
        super().__init__(seed=seed)
        self.path = Path(path)
        self.shuffle = shuffle  # False: records in file order (an evaluation set)
        rows = load_records(self.path, split=split, subset=subset, flag=flag)
        _check_field(rows, self.path, prompt_field, "data.prompt_field")
        # None: prompts only (TRL's prompt-only datasets), scored by the user's functions
        self.has_answers = answer_field is not None
        if self.has_answers:
            _check_field(rows, self.path, answer_field, "data.answer_field")
        self._messages = [_messages(r[prompt_field], i, self.path) for i, r in enumerate(rows)]
        self._conversational = [not isinstance(r[prompt_field], str) for r in rows]
        self._answers = ([self.make_answer(self._answer_text(r, answer_field, i), i)
                          for i, r in enumerate(rows)] if self.has_answers else [""] * len(rows))
        self._columns = [{k: v for k, v in r.items() if k != prompt_field} for r in rows]
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._answers)

    def _answer_text(self, record: dict, key: str, row: int) -> str:
        """The record's answer as text; a mapping or a list is refused: its text (verl's
        whole reward_model) is no answer a grader could ever match."""
        value = _field(record, key)
        if isinstance(value, dict):
            leaf = "ground_truth" if "ground_truth" in value else next(iter(value), "FIELD")
            raise HandoffError(f"record {row} of {self.path}{self._line_text(row)}: "
                               f"data.answer_field={key!r} is a mapping (keys: "
                               f"{', '.join(map(str, value)) or 'none'}), not an answer: point "
                               f"it at the field inside that holds the answer, e.g. "
                               f"data.answer_field={key}.{leaf}")
        if isinstance(value, (list, tuple)):
            raise HandoffError(f"record {row} of {self.path}{self._line_text(row)}: "
                               f"data.answer_field={key!r} is a list of {len(value)}, not one "
                               "answer: give each record one reference answer (a string or a "
                               "number), or grade the list with your own reward.functions and "
                               "set data.answer_field=null")
        return str(value)

    def make_answer(self, raw: str, row: int) -> str:
        """The reference as graded: canonical number when it reads as one, else the text."""
        try:
            return read_number(raw) or raw.strip()
        except UnreadableNumber:
            raise unreadable_answer(self.path, row, raw) from None

    def _record(self, index: int) -> int:
        epoch, pos = divmod(index, len(self))
        if not self.shuffle:
            return pos
        if self._order is None or self._order[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            self._order = (epoch, perm)
        return int(self._order[1][pos])

    def get(self, index: int) -> Problem:
        row = self._record(index)
        return Problem(messages=self._prompt(row), answer=self._answers[row], index=index,
                       metadata={"row": row, "path": str(self.path),
                                 "columns": dict(self._columns[row])},
                       conversational=self._conversational[row])

    def _prompt(self, row: int) -> tuple[dict[str, str], ...]:
        messages = [dict(m) for m in self._messages[row]]
        if self.instruction:
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{self.instruction}"
        return tuple(messages)

    def check_prompt_lengths(self, tokenizer: Any, *, limit: int, chat: bool,
                             setting: str, rows: int | None = None) -> None:
        """Refuse, at start, a record whose prompt takes more than `limit` tokens, naming it
        by its place in the data file (a JSONL file's line), not by a batch position; `rows`:
        only the first ones (an evaluation set's eval.n), else all."""
        for row in range(len(self) if rows is None else rows):
            problem = Problem(messages=self._prompt(row), answer="", index=row)
            n = len(encode_prompt(problem, tokenizer, chat=chat))
            if n > limit:
                raise HandoffError(f"record {row} of {self.path}{self._line_text(row)} has a "
                                   f"prompt of {n} tokens, more than the {limit} {setting} "
                                   "leaves for it: shorten or drop that record, or raise the "
                                   "limit")

    def _line_text(self, row: int) -> str:
        """' (line N)' for a JSON-lines file (its blank lines hold no record), else '' (also
        for a save_to_disk directory or a Hub dataset id, which have no lines)."""
        suffix = self.path.suffix.lower()
        if not self.path.is_file() or suffix in (".parquet", ".pq") or (
                suffix == ".json"
                and self.path.read_text(encoding="utf-8").lstrip().startswith("[")):
            return ""
        with open(self.path, encoding="utf-8") as f:
            filled = (n for n, line in enumerate(f, 1) if line.strip())
            return f" (line {next(itertools.islice(filled, row, None))})"

    def score(self, problem: Problem, response: str) -> Score:
        if normalize_number(problem.answer) == problem.answer:
            return score_numeric(response, problem.answer)
        return score_text(response, problem.answer)
