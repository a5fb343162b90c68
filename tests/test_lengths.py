"""Response lengths from a stated distribution (rollout.response_lengths)."""

import pytest

from handoff.config import load_config
from handoff.errors import ConfigError
from handoff.lengths import ResponseLengths


def test_lognormal_has_its_median_a_long_tail_and_its_cut():
    dist = ResponseLengths.parse("lognormal:median=700,sigma=0.9,max=4096")
    draws = sorted(dist.draw(seed=1, count=20000))
    assert draws[len(draws) // 2] == pytest.approx(700, rel=0.05)
    assert draws[-1] == dist.max == 4096 and draws[0] >= 1
    assert sum(draws) / len(draws) == pytest.approx(dist.mean, rel=0.03)
    assert dist.mean > 1.3 * 700          # the tail pulls the mean above the median


def test_draws_are_a_function_of_the_seed():
    dist = ResponseLengths.parse("uniform:min=10,max=20")
    assert dist.draw(seed=5, count=8) == dist.draw(seed=5, count=8)
    assert dist.draw(seed=5, count=8) != dist.draw(seed=6, count=8)
    assert set(dist.draw(seed=0, count=2000)) == set(range(10, 21))
    assert ResponseLengths.parse("fixed:7").draw(seed=0, count=3) == [7, 7, 7]


@pytest.mark.parametrize("spec", ["gamma:k=2", "lognormal:median=5", "uniform:min=9,max=3",
                                  "fixed:-1", "lognormal:median=5,sigma=1,max=nan",
                                  "uniform:min=1,max=2,extra=3"])
def test_a_bad_spec_is_one_config_error(spec):
    with pytest.raises(ConfigError, match="rollout.response_lengths"):
        load_config(None, [f"rollout.response_lengths={spec}"])
