"""GSM8K: word problems from a JSONL/Parquet file, graded by numeric answer extraction.

The file holds GSM8K's `question` and `answer` fields (set `data.prompt_field=question`) or
your own. An answer field that is a worked solution ending in `#### N` is reduced to N; the
prompt asks for the same marker, and `answers.score_numeric` grades the response (1.0 right
number, 0.1 wrong number in a marked format, 0.0 otherwise). A record whose N is not a
finite number the grader reads (`#### inf`, `#### 1e999`) is refused at start.
"""

from __future__ import annotations

from handoff.errors import HandoffError
from handoff.tasks.answers import UnreadableNumber, extract_answer, read_number, score_numeric
from handoff.tasks.base import Problem, Score
from handoff.tasks.dataset import DatasetTask, unreadable_answer

GSM8K_INSTRUCTION = "Think step by step, then give the final answer after '####'."


def reference_answer(answer: str) -> str | None:
    """N from a worked solution ending `#### N`, or from a bare number; None otherwise.

    Raises UnreadableNumber when that N is non-finite or absurd (see answers.py).
    """
    value, source = extract_answer(answer)
    if source == "hash":
        return value
    if source == "unreadable":
        raise UnreadableNumber(f"{answer[-60:]!r} holds a number no grader compares")
    # `#### inf` holds no number the extraction sees; read as a whole, it is refused.
    return read_number(answer.rsplit("####", 1)[-1])


class GSM8KTask(DatasetTask):
    """Word problems from a JSONL/Parquet file (GSM8K's `question`/`answer` or your fields)."""

    name = "gsm8k"
    instruction = GSM8K_INSTRUCTION

    def make_answer(self, raw: str, row: int) -> str:
        try:
            value = reference_answer(raw)
        except UnreadableNumber:
            raise unreadable_answer(self.path, row, raw) from None
        if value is None:
            raise HandoffError(f"record {row} of {self.path}: answer {raw[-60:]!r} has no "
                               "'#### N' and is not a number: use task=file for non-numeric "
                               "answers, or fix the record")
        return value

    def score(self, problem: Problem, response: str) -> Score:
        return score_numeric(response, problem.answer)
