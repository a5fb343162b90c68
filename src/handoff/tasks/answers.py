"""Reading an answer out of a response: GSM8K-style extraction and the rewards it feeds.

Where the answer is read from, first match wins:

1. `#### N` (GSM8K's own answer marker; the first number after the last marker),
2. `\\boxed{N}` (the last box),
3. the last number anywhere in the response (fallback, counts as unformatted).

Numbers are compared after normalisation: `$`, thousands commas, a leading `+`, spaces and a
trailing period are dropped, and the value is read exactly (`72.0` == `72` == `$72` ==
`72.`; `1,000` == `1000`; `0.5` == `1/2`). Reward: 1.0 for the right number however it
was found; 0.1 for a wrong number given in a marked format (`####` or `\\boxed`), which
rewards learning the format; 0.0 otherwise.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from handoff.tasks.base import Score

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1

# A number as people write it: optional sign (not right after a digit, so "17-5" reads 17
# and 5), optional $, thousands groups or plain digits, optional decimals and /denominator.
_NUMBER = r"(?:(?<!\d)[-+])?\\?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s?/\s?\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_FRAC_RE = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}")  # \frac{1}{2} -> 1/2


def normalize_number(text: str) -> str | None:
    """A canonical string for a written number (`"$1,000.0"` -> `"1000"`), None if not one."""
    s = text.strip().replace("\\$", "").replace("$", "").replace(",", "").replace(" ", "")
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            value = Fraction(Decimal(num)) / Fraction(Decimal(den))
        else:
            value = Fraction(Decimal(s))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None
    return _canonical(value)


def _canonical(value: Fraction) -> str:
    """Integers as integers, finite decimals as decimals (0.5), other ratios as p/q."""
    if value.denominator == 1:
        return str(value.numerator)
    rest = value.denominator
    for prime in (2, 5):
        while rest % prime == 0:
            rest //= prime
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    return format((Decimal(value.numerator) / Decimal(value.denominator)).normalize(), "f")


def _boxed_contents(text: str) -> str | None:
    """The contents of the last `\\boxed{...}`, with nested braces matched."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    begin = i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def _first_number(text: str) -> str | None:
    m = _NUMBER_RE.search(text)
    return normalize_number(m.group(0)) if m else None


def extract_answer(text: str) -> tuple[str | None, str]:
    """(canonical number or None, where it came from: "hash" | "boxed" | "last" | "none")."""
    if "####" in text:
        value = _first_number(text.rsplit("####", 1)[1])
        if value is not None:
            return value, "hash"
    boxed = _boxed_contents(text)
    if boxed is not None:
        boxed = _FRAC_RE.sub(r"\1/\2", boxed)
        value = normalize_number(boxed) or _first_number(boxed)
        if value is not None:
            return value, "boxed"
    numbers = _NUMBER_RE.findall(text)
    for candidate in reversed(numbers):
        value = normalize_number(candidate)
        if value is not None:
            return value, "last"
    return None, "none"


def score_numeric(response: str, reference: str) -> Score:
    """Grade `response` against a canonical numeric `reference` (see the module docstring)."""
    value, source = extract_answer(response)
    formatted = source in ("hash", "boxed")
    correct = value is not None and value == reference
    reward = CORRECT_REWARD if correct else (FORMAT_REWARD if formatted else 0.0)
    return Score(reward=reward, correct=correct, formatted=formatted, extracted=value)




def normalize_text(text: str) -> str:
    """Case, surrounding quotes and spaces, and a trailing period do not count."""
    return " ".join(text.strip().strip("\"'`").rstrip(".").split()).lower()


def extract_text_answer(text: str) -> tuple[str | None, str]:
    """A non-numeric answer: after the last `####`, in the last `\\boxed{}`, or the last line."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0], "hash"
    boxed = _boxed_contents(text)
    if boxed is not None:
        return boxed, "boxed"
    lines = [line for line in text.strip().split("\n") if line.strip()]
    return (lines[-1], "last") if lines else (None, "none")


def score_text(response: str, reference: str) -> Score:
    """Grade against a non-numeric reference by normalised exact match (rewards as numeric)."""
    value, source = extract_text_answer(response)
    formatted = source in ("hash", "boxed")
    correct = value is not None and normalize_text(value) == normalize_text(reference)
    reward = CORRECT_REWARD if correct else (FORMAT_REWARD if formatted else 0.0)
    return Score(reward=reward, correct=correct, formatted=formatted, extracted=value)
