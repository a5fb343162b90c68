"""Arithmetic problems generated in code, with an exact-match reward and a format reward.

    task = ArithmeticTask(digits=1, ops="+-", seed=0)
    task.get(0).prompt        # "What is 7 + 3? Answer with just the number."
    task.score(task.get(0), "10")   # Score(reward=1.0, correct=True, formatted=True, ...)

Difficulty is `digits` per operand (`data.difficulty`) and the operators drawn from `ops`
(`+`, `-`, `*`); subtraction puts the larger operand first so answers are never negative.
Problem i is a pure function of (seed, i), so a resumed run continues the same stream.
With `context_chars` each question follows a filler passage of that many characters: prompts
of a reasoning workload's length for benchmarks (`handoff bench sweep`).

The reward. The required format is one short line: the number alone ("10", " 10.") or
the problem's own equation ending in it ("7 + 3 = 10"; "7+3=10", and "7 x 3" for "7 * 3").

* 1.0: the response has the format and the number is right;
* 0.1: the format is right but the number is wrong;
* 0.0: anything else: the right number inside a sentence ("The answer is 10"), another
  equation ("3 + 7 = 10"), or the answer followed by more text (the model must stop).

Grading is bounded (answers.py's limits): a response over `MAX_EXAMINED_CHARS` characters
is not one short line, only its tail is searched for the last integer, and an integer of
more than `MAX_DIGITS` digits is a wrong answer (never converted: Python refuses to
convert one of over 4300 digits).

The equation form is accepted on purpose: it is how SmolLM2-135M-Instruct answers when it
is right (1-digit sums, greedy: 59% of answers in this format, 89% of those right). Made to
give the bare number, it learns the format within a few GRPO steps but its accuracy
collapses (measured: 25% -> 2%): restating the sum is what lets a 135M model add.
"""

from __future__ import annotations

import random
import re

from handoff.errors import HandoffError
from handoff.tasks.answers import MAX_DIGITS, MAX_EXAMINED_CHARS, examined
from handoff.tasks.base import Problem, Score, Task

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1
OPS = "+-*"
PROMPT = "What is {a} {op} {b}? Answer with just the number."
# The whole response: an optional "a op b =" and one integer, an optional trailing period.
_FORMAT = re.compile(r"\s*(?:(\d+)\s*([-+*x\u00d7])\s*(\d+)\s*=\s*)?([-+]?\d+)\.?\s*")
_SAME_OP = {"x": "*", "\u00d7": "*"}
_ANY_INTEGER = re.compile(r"[-+]?\d+")


def _integer(digits: str) -> int | None:
    """An integer as written (`+07` -> 7), None when it has more than MAX_DIGITS digits."""
    return int(digits) if len(digits.lstrip("+-")) <= MAX_DIGITS else None


def _filler(rng: random.Random, chars: int) -> str:
    """About `chars` characters of made-up lowercase words (a long prompt's bulk)."""
    words, size = [], -1      # the joined length: words plus the spaces between them
    while size < chars:
        word = "".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


class ArithmeticTask(Task):
    """`a op b` with `digits`-digit operands; the answer is an integer."""

    name = "arithmetic"

    def __init__(self, *, digits: int = 1, ops: str = "+-", seed: int = 0,
                 system_prompt: str | None = None, context_chars: int = 0) -> None:
        super().__init__(seed=seed)
        if not 1 <= digits <= 9:
            raise HandoffError(f"data.difficulty={digits}: digits per operand must be 1..9")
        bad = sorted(set(ops) - set(OPS))
        if not ops or bad:
            raise HandoffError(f"arithmetic ops {ops!r}: use a non-empty mix of {OPS!r}")
        self.digits = digits
        self.ops = "".join(dict.fromkeys(ops))  # keep order, drop repeats
        self.system_prompt = system_prompt
        self.context_chars = context_chars

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
        question = PROMPT.format(a=a, op=op, b=b)
        if self.context_chars:
            question = f"Notes: {_filler(rng, self.context_chars)}\n\n{question}"
        messages = [{"role": "user", "content": question}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Problem(messages=tuple(messages), answer=str(value), index=index,
                       metadata={"a": a, "b": b, "op": op})

    def score(self, problem: Problem, response: str) -> Score:
        m = _FORMAT.fullmatch(response) if len(response) <= MAX_EXAMINED_CHARS else None
        if m is not None and m.group(1) is not None:
            meta = problem.metadata
            restated = (_integer(m.group(1)), _SAME_OP.get(m.group(2), m.group(2)),
                        _integer(m.group(3)))
            if restated != (meta["a"], meta["op"], meta["b"]):
                m = None  # an equation, but not this problem's
        if m is None:
            # Unformatted: no reward, but `correct` still says whether the last integer was
            # right, so the logged accuracy separates "cannot add" from "says too much".
            found = _ANY_INTEGER.findall(examined(response))
            number = _integer(found[-1]) if found else None
            value = None if number is None else str(number)
            return Score(reward=0.0, correct=value == problem.answer, formatted=False,
                         extracted=value)
        number = _integer(m.group(4))
        value = None if number is None else str(number)
        correct = value == problem.answer
        return Score(reward=CORRECT_REWARD if correct else FORMAT_REWARD, correct=correct,
                     formatted=True, extracted=value)
