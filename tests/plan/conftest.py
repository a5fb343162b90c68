"""Shared helper for the plan tests: compare a computed figure with a published one.

A published figure is passed as the string the source printed ("2.3", "0.05", "130"), so
its rounding is known: a value passes when it lies within `rel` of the figure or within half
a unit of its last printed digit, whichever is wider.
"""

import pytest


def near(value: float, published: str, rel: float) -> bool:
    figure = float(published)
    decimals = len(published.split(".")[1]) if "." in published else 0
    half_unit = 0.5 * 10 ** -decimals
    return abs(value - figure) <= max(rel * abs(figure), half_unit) + 1e-12


@pytest.fixture
def published():
    def check(value: float, figure: str, rel: float, what: str = "") -> None:
        assert near(value, figure, rel), \
            f"{what}: computed {value:.4g}, published {figure} (±{rel:.0%})"
    return check
