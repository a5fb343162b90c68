"""GSM8K-style answer extraction: markers, fallbacks, number normalisation, the reward."""

import pytest

from handoff.tasks import extract_answer, normalize_number, score_numeric, score_text


@pytest.mark.parametrize("text, canon", [
    ("72", "72"), ("72.0", "72"), ("72.", "72"), ("$72", "72"), ("\\$72", "72"),
    ("1,000", "1000"), ("$1,234.50", "1234.5"), ("+5", "5"), ("-3", "-3"), ("0.5", "0.5"),
    ("1/3", "1/3"), ("2/6", "1/3"), ("-0.250", "-0.25"),
    ("1/2", "0.5"), (" 007 ", "7"), ("abc", None), ("", None), ("1/0", None),
])
def test_normalize_number(text, canon):
    assert normalize_number(text) == canon


@pytest.mark.parametrize("text, value, source", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", "hash"),
    ("#### 5 ... later #### $1,000", "1000", "hash"),
    ("so the total is \\boxed{1,234}.", "1234", "boxed"),
    ("\\boxed{\\frac{1}{2}}", "0.5", "boxed"),
    ("\\boxed{x = 12}", "12", "boxed"),
    ("#### 9 but \\boxed{8}", "9", "hash"),
    ("I think 12 apples, no wait 15.", "15", "last"),
    ("17-5 makes 12", "12", "last"),
    ("it costs $3.50 total", "3.5", "last"),
    ("no numbers here", None, "none"),
    ("#### unknown, maybe 4", "4", "hash"),
])
def test_extract_answer(text, value, source):
    assert extract_answer(text) == (value, source)


def test_numeric_reward_levels():
    assert score_numeric("The answer is 72.", "72").reward == 1.0  # last number, right
    right = score_numeric("#### 72.00", "72")
    assert (right.reward, right.correct, right.formatted) == (1.0, True, True)
    wrong = score_numeric("\\boxed{71}", "72")
    assert (wrong.reward, wrong.correct, wrong.formatted) == (0.1, False, True)
    assert score_numeric("it is 71", "72").reward == 0.0
    assert score_numeric("", "72").reward == 0.0


def test_text_reward():
    assert score_text("Thinking...\nParis.", "paris").reward == 1.0
    assert score_text("#### Paris", "Paris").formatted
    assert score_text("#### Lyon", "Paris").reward == 0.1
    assert score_text("It is Paris, I think", "Paris").reward == 0.0
