"""Prompts with verifiable rewards: `build_task(cfg.data, seed=...)` picks one.

* `arithmetic` (arithmetic.py): generated in code, digits per operand = `data.difficulty`;
* `gsm8k` (gsm8k.py): word problems from `data.path`, GSM8K-style numeric answer extraction;
* `file` (dataset.py): your JSONL/Parquet prompts and answers, field names configurable;
  also a `datasets` save_to_disk directory or a cached Hub dataset id (saved_datasets.py).

`build_eval_problems(cfg.data, cfg.eval, seed=...)` gives the evaluation set
(`data.eval_path`): its task and its first `eval.n` problems in file order.

Every task is a resumable stream (`sample`, `state_dict`, `load_state_dict`) with a
`score(problem, response) -> Score` (reward + correct/formatted flags); see base.py.
"""

from __future__ import annotations

from handoff.config import DataConfig, EvalConfig
from handoff.errors import HandoffError
from handoff.tasks.answers import extract_answer, normalize_number, score_numeric, score_text
from handoff.tasks.arithmetic import ArithmeticTask
from handoff.tasks.base import Problem, Score, Task, encode_prompt, render_prompt
from handoff.tasks.dataset import DatasetTask, load_records
from handoff.tasks.gsm8k import GSM8KTask

__all__ = ["ArithmeticTask", "DatasetTask", "GSM8KTask", "Problem", "Score", "Task",
           "build_eval_problems", "build_task", "encode_prompt", "extract_answer",
           "load_records", "normalize_number", "render_prompt", "score_numeric", "score_text"]


def build_task(data: DataConfig, *, seed: int = 0) -> Task:
    """The task that `data.task` names, configured from the `data` section."""
    if data.task == "arithmetic":
        return ArithmeticTask(digits=data.difficulty, ops=data.ops, seed=seed,
                              context_chars=data.context_chars)
    if data.path is None:
        raise HandoffError(f"data.task={data.task} reads its problems from a file: set "
                           "data.path to a JSONL or Parquet file")
    if data.task == "gsm8k" and data.answer_field is None:
        raise HandoffError("data.task=gsm8k grades against its answers: set data.answer_field "
                           "(data.task=file reads prompts alone)")
    cls = GSM8KTask if data.task == "gsm8k" else DatasetTask
    return cls(data.path, prompt_field=data.prompt_field, answer_field=data.answer_field,
               seed=seed, split=data.split, subset=data.subset)


def build_eval_problems(data: DataConfig, evaluation: EvalConfig, *,
                        seed: int = 0) -> tuple[Task, list[Problem]] | None:
    """The evaluation set and the task that grades it, or None when there is none.

    With `data.eval_path`: data.task's own task for gsm8k (a file task otherwise) on that
    source, read with the same loaders as data.path, its first `eval.n` problems in file order
    (all of them when n is 0). Without it, for task=arithmetic with eval.n > 0: the first n
    problems of the stream of seed -1 - seed, which no run trains on (run.seed >= 0)."""
    if data.eval_path is None:
        if data.task != "arithmetic" or evaluation.n == 0:
            return None
        task = ArithmeticTask(digits=data.difficulty, ops=data.ops, seed=-1 - seed,
                              context_chars=data.context_chars)
        return task, [task.get(i) for i in range(evaluation.n)]
    cls = GSM8KTask if data.task == "gsm8k" else DatasetTask
    task = cls(data.eval_path, prompt_field=data.prompt_field, answer_field=data.answer_field,
               seed=seed, split=data.eval_split, subset=data.subset, shuffle=False,
               flag="data.eval_path")
    count = len(task) if evaluation.n == 0 else min(evaluation.n, len(task))
    return task, [task.get(i) for i in range(count)]
