"""Prompts with verifiable rewards: `build_task(cfg.data, seed=...)` picks one.

* `arithmetic` (arithmetic.py): generated in code, digits per operand = `data.difficulty`;
* `gsm8k` (gsm8k.py): word problems from `data.path`, GSM8K-style numeric answer extraction;
* `file` (dataset.py): your JSONL/Parquet prompts and answers, field names configurable.

Every task is a resumable stream (`sample`, `state_dict`, `load_state_dict`) with a
`score(problem, response) -> Score` (reward + correct/formatted flags); see base.py.
"""

from __future__ import annotations

from handoff.config import DataConfig
from handoff.errors import HandoffError
from handoff.tasks.answers import extract_answer, normalize_number, score_numeric, score_text
from handoff.tasks.arithmetic import ArithmeticTask
from handoff.tasks.base import Problem, Score, Task, encode_prompt, render_prompt
from handoff.tasks.dataset import DatasetTask, load_records
from handoff.tasks.gsm8k import GSM8KTask

__all__ = ["ArithmeticTask", "DatasetTask", "GSM8KTask", "Problem", "Score", "Task",
           "build_task", "encode_prompt", "extract_answer", "load_records", "normalize_number",
           "render_prompt", "score_numeric", "score_text"]


def build_task(data: DataConfig, *, seed: int = 0) -> Task:
    """The task that `data.task` names, configured from the `data` section."""
    if data.task == "arithmetic":
        return ArithmeticTask(digits=data.difficulty, ops=data.ops, seed=seed,
                              context_chars=data.context_chars)
    if data.path is None:
        raise HandoffError(f"data.task={data.task} reads its problems from a file: set "
                           "data.path to a JSONL or Parquet file")
    cls = GSM8KTask if data.task == "gsm8k" else DatasetTask
    return cls(data.path, prompt_field=data.prompt_field, answer_field=data.answer_field,
               seed=seed)
