"""The built-in graders as named rewards, so a config can mix them with user functions.

* `handoff:task`: the task's own grader (`Task.score`: arithmetic's format rule, GSM8K's
  `#### N`, a file's numeric or exact match); the default when `reward.functions` is empty;
* `handoff:numeric`: `answers.score_numeric` against the problem's answer read as a number;
* `handoff:exact`: `answers.score_text`, normalised exact match of the marked answer.

Each is called per sample as `grader(problem, completion_text) -> Score`, so besides the
reward it gives accuracy (`correct`) and format rate (`formatted`).
"""

from __future__ import annotations

from typing import Callable

from handoff.errors import HandoffError
from handoff.rewards.loading import BUILTIN, BUILTIN_PREFIX, RewardFunction
from handoff.tasks import Problem, Score, Task, normalize_number, score_numeric, score_text

Grader = Callable[[Problem, str], Score]


def numeric(problem: Problem, response: str) -> Score:
    reference = normalize_number(problem.answer)
    if reference is None:
        raise ValueError(f"the reference answer {problem.answer!r} is not a number: use "
                         "handoff:exact for text answers")
    return score_numeric(response, reference)


def exact(problem: Problem, response: str) -> Score:
    return score_text(response, problem.answer)


def builtin(spec: str, task: Task) -> RewardFunction:
    """The built-in reward `handoff:NAME`, bound to `task` for handoff:task."""
    name = spec.strip()[len(BUILTIN_PREFIX):]
    graders: dict[str, Grader] = {"task": task.score, "numeric": numeric, "exact": exact}
    if name not in graders:
        raise HandoffError(f"reward spec {spec!r} is not a built-in reward: use one of "
                           f"{', '.join(BUILTIN_PREFIX + k for k in graders)}")
    return RewardFunction(name, graders[name], BUILTIN, spec=None)
