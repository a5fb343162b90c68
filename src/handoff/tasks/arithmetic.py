"""Arithmetic problems generated in code, with an exact-match reward and a format reward.

    task = ArithmeticTask(digits=1, ops="+-", seed=0)
    task.get(0).prompt        # "What is 7 + 3? Answer with just the number."
    task.score(task.get(0), "10")   # Score(reward=1.0, correct=True, formatted=True, ...)

Difficulty is `digits` per operand (`data.difficulty`) and the operators drawn from `ops`
(`+`, `-`, `*`); subtraction puts the larger operand first so answers are never negative.
Problem i is a pure function of (seed, i), so a resumed run continues the same stream.

The reward (the prompt asks for "just the number"):

* 1.0: the response is the number alone and it is right ("10", " 10.", "10\\n");
* 0.1: the response is a number alone but the wrong one (right format, wrong value);
* 0.0: anything else, including the right number inside a sentence ("7 + 3 = 10"): the
  format is part of the task, and a GRPO group learns it quickly from the 1.0 samples.
"""

from __future__ import annotations

import random
import re

from handoff.errors import HandoffError
from handoff.tasks.base import Problem, Score, Task

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1
OPS = "+-*"
PROMPT = "What is {a} {op} {b}? Answer with just the number."
# The whole response must be one integer, optionally with a trailing period and spaces.
_JUST_A_NUMBER = re.compile(r"\s*([-+]?\d+)\.?\s*")
_ANY_INTEGER = re.compile(r"[-+]?\d+")


class ArithmeticTask(Task):
    """`a op b` with `digits`-digit operands; the answer is an integer."""

    name = "arithmetic"

    def __init__(self, *, digits: int = 1, ops: str = "+-", seed: int = 0,
                 system_prompt: str | None = None) -> None:
        super().__init__(seed=seed)
        if not 1 <= digits <= 9:
            raise HandoffError(f"data.difficulty={digits}: digits per operand must be 1..9")
        bad = sorted(set(ops) - set(OPS))
        if not ops or bad:
            raise HandoffError(f"arithmetic ops {ops!r}: use a non-empty mix of {OPS!r}")
        self.digits = digits
        self.ops = "".join(dict.fromkeys(ops))  # keep order, drop repeats
        self.system_prompt = system_prompt

    def _operand(self, rng: random.Random) -> int:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return rng.randint(low, 10 ** self.digits - 1)

    def get(self, index: int) -> Problem:
        if index < 0:
            raise HandoffError(f"problem index {index} is negative: indices start at 0")
        # A string seed is hashed with SHA-512 by `random`: stable across Python versions.
        rng = random.Random(f"arithmetic:{self.seed}:{index}")
        a, b = self._operand(rng), self._operand(rng)
        op = self.ops[rng.randrange(len(self.ops))]
        if op == "-" and b > a:
            a, b = b, a
        value = a + b if op == "+" else a - b if op == "-" else a * b
        messages = [{"role": "user", "content": PROMPT.format(a=a, op=op, b=b)}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Problem(messages=tuple(messages), answer=str(value), index=index,
                       metadata={"a": a, "b": b, "op": op})

    def score(self, problem: Problem, response: str) -> Score:
        m = _JUST_A_NUMBER.fullmatch(response)
        if m is None:
            # Unformatted: no reward, but `correct` still says whether the last integer was
            # right, so the logged accuracy separates "cannot add" from "says too much".
            found = _ANY_INTEGER.findall(response)
            value = str(int(found[-1])) if found else None
            return Score(reward=0.0, correct=value == problem.answer, formatted=False,
                         extracted=value)
        value = str(int(m.group(1)))
        correct = value == problem.answer
        return Score(reward=CORRECT_REWARD if correct else FORMAT_REWARD, correct=correct,
                     formatted=True, extracted=value)
