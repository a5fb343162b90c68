"""Console text compared across line wraps."""


def flat(text: str) -> str:
    """Text without its whitespace: the console wraps long lines anywhere, even inside a path
    (a test's tmp path is longer under pytest-xdist)."""
    return "".join(text.split())
