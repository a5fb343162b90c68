"""Model output is untrusted: every grader returns a reward in [0, 1], never raises, never
stalls (it reads a bounded tail, caps digits, evaluates nothing), and a data file's answer
that no grader can compare is refused at start, naming the record."""

import json
import math
import random
import re

import pytest

from handoff.errors import HandoffError
from handoff.tasks import ArithmeticTask, DatasetTask, GSM8KTask, answers, arithmetic
from handoff.tasks.answers import (
    MAX_DIGITS, MAX_EXAMINED_CHARS, extract_answer, normalize_number, score_numeric, score_text,
)

# Pieces a sampled response can be made of: markers, non-finite words, huge exponents and
# powers, long digit runs, separators that make number regexes try many splits.
PIECES = ["\\boxed{", "}", "{", "####", "inf", "-inf", "Infinity", "nan", "NaN", "sNaN",
          "1e999999999", "1E-99999", "10**10**10", "2^8", "**", "^", "9" * 5000, "0" * 5000,
          "1" * 100_000, "1,000", ",", "1,", ".", "/", "/0", "$", "\\$", "+", "-", " ",
          "\n", "\\frac{1}{", "\\dfrac{", "e", "e+", "42", "0.5", "1/3", "7 + 3 = ", "Paris",
          "\ud800", "\x00", "١٢٣", "½", "=", "x"]
NUMERIC_REFERENCES = ["42", "0.5", "1/3", "-3", "1000"]


def _adversarial(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
            for _ in range(count)]


def _graders():
    """(name, score(response) -> Score) for every grader a run can use."""
    arith = ArithmeticTask(digits=2, ops="+-*", seed=0)
    arith_problem = arith.get(3)
    yield "arithmetic", lambda r: arith.score(arith_problem, r)
    for ref in NUMERIC_REFERENCES:
        yield f"numeric {ref}", lambda r, ref=ref: score_numeric(r, ref)
    yield "text", lambda r: score_text(r, "Paris")
    # The same graders as named rewards (handoff:numeric, handoff:exact) in reward.functions.
    from handoff.rewards.builtin import exact, numeric
    from handoff.tasks import Problem

    asked = ({"role": "user", "content": "q"},)
    yield "reward numeric", lambda r: numeric(Problem(messages=asked, answer="1,000", index=0), r)
    yield "reward exact", lambda r: exact(Problem(messages=asked, answer="Paris", index=0), r)


def _in_range(score) -> bool:
    return (isinstance(score.reward, float) and math.isfinite(score.reward)
            and 0.0 <= score.reward <= 1.0)


def test_every_grader_returns_a_reward_in_range_for_adversarial_responses():
    responses = _adversarial(300) + PIECES
    graded = 0
    for name, score in _graders():
        for response in responses:
            result = score(response)
            assert _in_range(result), (name, response[:80], result)
            # What was read back is a short canonical number or the text's own words.
            if name not in ("text", "reward exact") and result.extracted is not None:
                assert len(result.extracted) <= 2 * MAX_DIGITS + 2, (name, response[:80])
            graded += 1
    assert graded == len(responses) * (4 + len(NUMERIC_REFERENCES))


@pytest.mark.parametrize("response", [
    "\\boxed{inf}", "\\boxed{-Infinity}", "\\boxed{nan}", "\\boxed{sNaN}", "#### inf",
    "\\boxed{1e999999999}", "#### 1e999999999", "the answer is 1e999999999",
    "\\boxed{10**10**10}", "#### 10**10**10", "\\boxed{2^42}", "1" * 100_000,
    "#### " + "4" * 100_000, "\\boxed{" + "9" * 70 + "}", "\\boxed{1e65}", "\\boxed{0" * 3 + "}",
])
def test_a_non_finite_or_absurd_answer_is_wrong_and_never_raises(response):
    for reference in NUMERIC_REFERENCES:
        result = score_numeric(response, reference)
        assert not result.correct and _in_range(result)


def test_an_absurd_last_number_is_the_answer_not_skipped_for_an_earlier_one():
    # Skipping it would grade the earlier 42 as the answer: the response ends wrong.
    assert extract_answer("first 42, finally 1e999999999") == (None, "unreadable")
    assert not score_numeric("first 42, finally 10**10**10", "42").correct
    assert not score_numeric("#### 1e999999999, or 42", "42").correct


def test_an_exponent_within_bounds_is_read_exactly():
    assert normalize_number("1.5e3") == "1500"
    assert normalize_number(f"1e-{answers.MAX_EXPONENT}") == "0." + "0" * 63 + "1"
    assert normalize_number(f"1e{answers.MAX_EXPONENT + 1}") is None
    # Beyond Decimal's default 28 digits of precision, still exact.
    assert normalize_number("0.123456789012345678901234567890123") == \
        "0.123456789012345678901234567890123"
    assert normalize_number("9" * MAX_DIGITS) == "9" * MAX_DIGITS
    assert normalize_number("9" * (MAX_DIGITS + 1)) is None


class _CountingPattern:
    """A compiled pattern that records the length of every string it is asked to scan."""

    def __init__(self, pattern: re.Pattern, seen: list[int]):
        self._pattern, self._seen = pattern, seen

    def __getattr__(self, name):
        method = getattr(self._pattern, name)

        def scan(text, *args, **kwargs):
            self._seen.append(len(text))
            return method(text, *args, **kwargs)
        return scan


# Inputs on which a careless number regex backtracks for a long time: long runs of what
# almost makes a number, separators after every digit, unclosed boxes, whitespace runs.
BACKTRACKING_PRONE = [
    "1," * 200_000, "1 / " * 100_000, " " * 400_000 + "x", "1**" * 100_000, "$ " * 200_000,
    "\\boxed{" * 50_000, "{" * 400_000, "1." * 200_000, "1e" * 200_000, "-" * 400_000 + "1",
    "1" * 400_000 + "x", "#### " + "1,00" * 100_000, "7 + 3 = " * 50_000, "1 + " * 100_000 + "=",
]


def test_parsing_only_examines_a_bounded_tail_of_backtracking_prone_inputs(monkeypatch):
    seen: list[int] = []
    for module, names in ((answers, ("_NUMBER_RE", "_FRAC_RE", "_DECIMAL_RE")),
                          (arithmetic, ("_FORMAT", "_ANY_INTEGER"))):
        for name in names:
            monkeypatch.setattr(module, name, _CountingPattern(getattr(module, name), seen))
    handled = 0
    for response in BACKTRACKING_PRONE:
        assert len(response) > MAX_EXAMINED_CHARS
        for _, score in _graders():
            assert _in_range(score(response))
        handled += 1
    assert handled == len(BACKTRACKING_PRONE) == 14
    assert seen and max(seen) <= MAX_EXAMINED_CHARS


def test_text_before_the_examined_tail_does_not_change_any_grade():
    for response in _adversarial(60, seed=1) + ["#### 42", "\\boxed{42}", "7 + 3 = 10"]:
        padded = "9" * (MAX_EXAMINED_CHARS + 17) + response
        for name, score in _graders():
            if name == "arithmetic":
                continue   # one short line by definition: a padded response is never one
            assert score(padded[-MAX_EXAMINED_CHARS:]) == score(padded), (name, response[:40])


def test_arithmetic_grades_a_huge_integer_as_wrong_without_converting_it():
    task = ArithmeticTask(digits=1, ops="+", seed=0)
    problem = task.get(0)
    for response in ["1" * 5000, "1" * 5000 + ".", f"{problem.metadata['a']} + "
                     f"{problem.metadata['b']} = {'9' * 5000}"]:
        result = task.score(problem, response)
        assert not result.correct and result.reward in (0.0, 0.1)
    # Operands of 5000 digits are not this problem's: unformatted, whatever the last number.
    assert task.score(problem, f"{'4' * 5000} + 1 = {problem.answer}").reward == 0.0
    assert task.score(problem, " " * (MAX_EXAMINED_CHARS + 1) + problem.answer).reward == 0.0
    assert task.score(problem, f"  {problem.answer}.  ").reward == 1.0


def _jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("answer", [
    '"inf"', '"-Infinity"', '"NaN"', "NaN", "Infinity", "1e999", '"1e999999999"',
    '"10**10**10"', '"2^8"', '"' + "9" * 100 + '"', '"1e65"',
])
def test_a_data_file_answer_no_grader_can_compare_is_refused_naming_the_record(tmp_path, answer):
    path = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": 1}',
                                         f'{{"prompt": "b", "answer": {answer}}}'])
    with pytest.raises(HandoffError, match=r"record 1 of .*d\.jsonl.*not a finite number") as e:
        DatasetTask(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("solution", ["So #### inf", "So #### 1e999999999", "#### 10**10**10",
                                      "#### " + "3" * 100, "-Infinity"])
def test_a_gsm8k_answer_no_grader_can_compare_is_refused_naming_the_record(tmp_path, solution):
    path = _jsonl(tmp_path / "g.jsonl", [json.dumps({"question": "q", "answer": "#### 3"}),
                                         json.dumps({"question": "q", "answer": solution})])
    with pytest.raises(HandoffError, match=r"record 1 of .*g\.jsonl.*not a finite number"):
        GSM8KTask(path, prompt_field="question")


def test_a_json_integer_too_long_for_python_is_refused_naming_the_line(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": 1}',
                                         '{"prompt": "b", "answer": ' + "7" * 5000 + "}"])
    with pytest.raises(HandoffError, match=r"d\.jsonl:2 holds a number Python will not read"):
        DatasetTask(path)


def test_a_dataset_grader_stays_in_range_on_adversarial_responses(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": 42}',
                                         '{"prompt": "b", "answer": "Paris"}'])
    task = DatasetTask(path)
    problems = task.sample(2)
    for response in _adversarial(100, seed=2):
        for problem in problems:
            assert _in_range(task.score(problem, response))
