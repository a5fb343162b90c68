"""Reading an answer out of a response: GSM8K-style extraction and the rewards it feeds.

Where the answer is read from, first match wins:

1. `#### N` (GSM8K's own answer marker; the first number after the last marker),
2. `\\boxed{N}` (the last box),
3. the last number anywhere in the response (fallback, counts as unformatted).

Numbers are compared after normalisation: `$`, thousands commas, a leading `+`, spaces and a
trailing period are dropped, and the value is read exactly (`72.0` == `72` == `$72` ==
`72.`; `1,000` == `1000`; `0.5` == `1/2`; `1.5e3` == `1500`). Reward: 1.0 for the right
number however it was found; 0.1 for a wrong number given in a marked format (`####` or
`\\boxed`), which rewards learning the format; 0.0 otherwise.

Model output is untrusted, and a seeded resume replays it, so grading is bounded and never
raises: only the last `MAX_EXAMINED_CHARS` characters of a response are read, and a number
that is non-finite (`inf`, `nan`), longer than `MAX_DIGITS` digits, scaled beyond
`MAX_EXPONENT`, or a power (`10**10**10`, `2^8`: never evaluated) where the answer is read
is a wrong answer (reward 0.0), not a value to compute.
"""

from __future__ import annotations

import re
from fractions import Fraction

from handoff.tasks.base import Score

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1
MAX_EXAMINED_CHARS = 8192   # the answer sits at the end; a longer response is read from its tail
MAX_DIGITS = 64             # digits of one number: far beyond any graded answer
MAX_EXPONENT = 64           # |e| of `1.5e3`-style scaling

# A number as people write it: optional sign (not right after a digit, so "17-5" reads 17
# and 5), optional $, thousands groups or plain digits, optional decimals, exponent,
# /denominator, and powers (read only to be refused). Every repeated part starts with a
# distinct literal, so a match attempt never backtracks more than linearly.
_NUMBER = (r"(?:(?<!\d)[-+])?\\?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
           r"(?:\s?/\s?\d+)?(?:\s*(?:\*\*|\^)\s*[-+]?\d+)*")
_NUMBER_RE = re.compile(_NUMBER)
_FRAC_RE = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}")  # \frac{1}{2} -> 1/2
_DECIMAL_RE = re.compile(r"-?(?P<int>\d*)(?:\.(?P<frac>\d*))?(?:[eE](?P<exp>[-+]?\d+))?")
_NON_FINITE_RE = re.compile(r"-?(?:inf(?:inity)?|s?nan)", re.IGNORECASE)
_POWER_RE = re.compile(r"-?[\d.]+(?:\*\*|\^)")


class UnreadableNumber(ValueError):
    """Written as a number, but not a finite value the grader reads (see the docstring)."""


def examined(text: str) -> str:
    """The part of a response that grading reads: its last MAX_EXAMINED_CHARS characters."""
    return text[-MAX_EXAMINED_CHARS:]


def _decimal(s: str) -> Fraction | None:
    """`-12.5e3` exactly, None if `s` is not a decimal; UnreadableNumber if absurd."""
    m = _DECIMAL_RE.fullmatch(s)
    if m is None or not (m["int"] or m["frac"]):
        return None
    whole, frac, exp = m["int"], m["frac"] or "", m["exp"] or "0"
    if len(whole) + len(frac) > MAX_DIGITS or len(exp.lstrip("+-")) > 3 \
            or abs(int(exp)) > MAX_EXPONENT:
        raise UnreadableNumber(f"{s[:40]!r} has more than {MAX_DIGITS} digits or an "
                               f"exponent beyond {MAX_EXPONENT}")
    value = Fraction(int(whole + frac or "0"), 10 ** len(frac)) * Fraction(10) ** int(exp)
    return -value if s.startswith("-") else value


def read_number(text: str) -> str | None:
    """A canonical string for a written number (`"$1,000.0"` -> `"1000"`), None if not one.

    Raises UnreadableNumber for one written as a number that is non-finite, too long, too
    far scaled or a power; it never evaluates anything and never builds a huge integer.
    """
    s = text.strip().replace("\\$", "").replace("$", "").replace(",", "").replace(" ", "")
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    if _NON_FINITE_RE.fullmatch(s) or _POWER_RE.match(s):
        raise UnreadableNumber(f"{s[:40]!r} is not a finite number written out")
    num, slash, den = s.partition("/")
    numerator = _decimal(num)
    denominator = _decimal(den) if slash else Fraction(1)
    if numerator is None or denominator is None or denominator == 0:
        return None
    return _canonical(numerator / denominator)


def normalize_number(text: str) -> str | None:
    """read_number, with None for an unreadable number too (never raises)."""
    try:
        return read_number(text)
    except UnreadableNumber:
        return None


def _canonical(value: Fraction) -> str:
    """Integers as integers, finite decimals as decimals (0.5), other ratios as p/q."""
    if value.denominator == 1:
        return str(value.numerator)
    twos = fives = 0
    rest = value.denominator
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)   # value * 10**places is an integer: write it, then the point
    digits = str(abs(value.numerator) * (10 ** places // value.denominator)).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


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
    return read_number(m.group(0)) if m else None


def _last_number(text: str) -> str | None:
    for candidate in reversed(_NUMBER_RE.findall(text)):
        value = read_number(candidate)
        if value is not None:
            return value
    return None


def _find_answer(text: str) -> tuple[str | None, str]:
    if "####" in text:
        value = _first_number(text.rsplit("####", 1)[1])
        if value is not None:
            return value, "hash"
    boxed = _boxed_contents(text)
    if boxed is not None:
        boxed = _FRAC_RE.sub(r"\1/\2", boxed)
        value = read_number(boxed) or _first_number(boxed)
        if value is not None:
            return value, "boxed"
    value = _last_number(text)
    return (value, "last") if value is not None else (None, "none")


def extract_answer(text: str) -> tuple[str | None, str]:
    """(canonical number or None, where it came from: "hash" | "boxed" | "last" | "none").

    An unreadable number where the answer was looked for (`\\boxed{inf}`) gives
    (None, "unreadable"): an answer was given, and it is wrong.
    """
    try:
        return _find_answer(examined(text))
    except UnreadableNumber:
        return None, "unreadable"


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
    text = examined(text)
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
