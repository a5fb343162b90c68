"""A reward that raises, returns NaN/inf, a wrong length or a wrong type, and a spec that
cannot be loaded: each is one HandoffError line naming the function, the sample and the value."""

from pathlib import Path

import pytest

from handoff.config import RewardConfig, load_config
from handoff.errors import ConfigError, HandoffError
from handoff.rewards import RewardSet, Sample
from handoff.tasks import ArithmeticTask, Problem

FIXTURES = Path(__file__).parent / "fixtures"
BAD = FIXTURES / "bad_rewards.py"
TASK = ArithmeticTask(seed=0)


def _samples(texts=("a", "b", "boom", "d")) -> list[Sample]:
    problem = Problem(messages=({"role": "user", "content": "q"},), answer="1", index=0,
                      metadata={"columns": {}})
    return [Sample(problem, "q", t, [1]) for t in texts]


def _error(spec: str, *, workers: int = 0, rank: int | None = None) -> str:
    with RewardSet.from_config(RewardConfig(functions=[spec], workers=workers), TASK,
                               rank=rank) as rewards:
        with pytest.raises(HandoffError) as e:
            rewards.score(_samples())
    message = str(e.value)
    assert "\n" not in message
    return message


CASES = {
    "raises": "reward raises raised ZeroDivisionError on samples 0..3: float division by zero: fix "
              "the function",
    "gives_nan": "reward gives_nan gave nan for sample 1: return a finite float, or None",
    "gives_inf": "reward gives_inf gave -inf for sample 0: return a finite float",
    "one_short": "reward one_short returned 3 values for 4 completions (samples 0..3)",
    "gives_text": "reward gives_text gave 'good' (str) for sample 2: return a float, or None",
    "gives_a_huge_int": "reward gives_a_huge_int gave 1000000000000000000000000000000000000000000"
                        "00000000000000... for sample 0, which is not a float",
    "calls_sys_exit": "reward calls_sys_exit raised SystemExit(3) on samples 0..3",
    "gives_past_float32": "reward gives_past_float32 gave 1e+39 for sample 0, past +-1e+15, "
                          "where the advantages' float32 statistics overflow",
    "gives_a_float": "reward gives_a_float returned 1.0 (float) for samples 0..3, not a list",
    "verl_raises": "reward verl_raises raised KeyError on sample 2: 'no answer': fix the "
                   "function",
    "verl_dict_without_score": "reward verl_dict_without_score returned a dict without 'score' "
                               "for sample 0 (keys: acc)",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_reward_is_one_line_naming_the_function_sample_and_value(name):
    assert CASES[name] in _error(f"{BAD}:{name}")


RANKED_CASES = {
    "raises": "reward raises raised ZeroDivisionError on rank 1, samples 0..3 of its batch: "
              "float division by zero",
    "gives_nan": "reward gives_nan gave nan for rank 1, sample 1 of its batch: return a finite",
    "one_short": "reward one_short returned 3 values for 4 completions (rank 1, samples 0..3 of "
                 "its batch)",
    "verl_raises": "reward verl_raises raised KeyError on rank 1, sample 2 of its batch",
    "verl_dict_without_score": "reward verl_dict_without_score returned a dict without 'score' "
                               "for rank 1, sample 0 of its batch (keys: acc)",
}


@pytest.mark.parametrize("name", sorted(RANKED_CASES))
def test_under_torchrun_a_bad_reward_names_the_rank_whose_sample_it_is(name):
    """Each rank numbers its own samples from 0: "sample 2" alone would not say whose."""
    assert RANKED_CASES[name] in _error(f"{BAD}:{name}", rank=1)


def test_a_builtin_and_a_weighted_total_name_the_rank_too():
    problem = Problem(messages=({"role": "user", "content": "q"},), answer="Paris", index=0)
    rewards = RewardSet.from_config(RewardConfig(functions=["handoff:numeric"]), TASK, rank=3)
    with pytest.raises(HandoffError, match=r"reward numeric raised ValueError on rank 3, "
                                           r"sample 0 of its batch: the reference answer"):
        rewards.score([Sample(problem, "q", "Paris", [1])])
    with RewardSet.from_config(RewardConfig(functions=[f"{BAD}:gives_half_the_limit"],
                                            weights=[2.0]), TASK, rank=1) as rewards:
        with pytest.raises(HandoffError, match=r"the weighted total of rank 1, sample 0 of its "
                                               r"batch is 1.2e\+15"):
            rewards.score(_samples())


def test_a_weighted_total_past_the_limit_is_one_line():
    with RewardSet.from_config(RewardConfig(functions=[f"{BAD}:gives_half_the_limit"],
                                            weights=[2.0]), TASK) as rewards:
        with pytest.raises(HandoffError, match=r"the weighted total of sample 0 is 1.2e\+15 "
                                               r"\(reward.weights \[2.0\]\), past \+-1e\+15"):
            rewards.score(_samples())


@pytest.mark.slow   # spawns a worker
def test_a_bad_reward_in_a_worker_pool_gives_the_same_line():
    assert CASES["gives_nan"] in _error(f"{BAD}:gives_nan", workers=1)
    assert CASES["verl_raises"] in _error(f"{BAD}:verl_raises", workers=1)
    assert CASES["calls_sys_exit"] in _error(f"{BAD}:calls_sys_exit", workers=1)
    assert RANKED_CASES["verl_raises"] in _error(f"{BAD}:verl_raises", workers=1, rank=1)


@pytest.mark.slow   # spawns a worker
def test_a_worker_that_dies_is_one_line_naming_the_function():
    message = _error(f"{BAD}:exits_the_process", workers=1)
    assert message.startswith("reward exits_the_process failed in a reward.workers process "
                              "(BrokenProcessPool")
    assert message.endswith("run it in process (reward.workers=0)")


def test_a_builtin_that_cannot_grade_a_sample_names_it():
    problem = Problem(messages=({"role": "user", "content": "q"},), answer="Paris", index=0)
    rewards = RewardSet.from_config(RewardConfig(functions=["handoff:numeric"]), TASK)
    with pytest.raises(HandoffError, match=r"reward numeric raised ValueError on sample 0: the "
                       r"reference answer 'Paris' is not a number: use handoff:exact"):
        rewards.score([Sample(problem, "q", "Paris", [1])])


SPEC_CASES = {
    "missing file": (f"{FIXTURES}/nowhere.py:f", r"reward file '.*nowhere.py' not found \(a "
                     r"relative path is read from the current directory"),
    "missing name": (f"{BAD}:absent", r"bad_rewards.py has no 'absent' \(its callables: "
                     r"calls_sys_exit, exits_the_process, gives_a_float, gives_a_huge_int, gives_half_the_limit, .*\): fix the name after the colon"),
    "not callable": (f"{BAD}:NOT_A_FUNCTION", r"NOT_A_FUNCTION is a int, not a function"),
    "unknown built-in": ("handoff:accuracy", r"'handoff:accuracy' is not a built-in reward: use "
                         r"one of handoff:task, handoff:numeric, handoff:exact"),
    "no colon": ("rewards.py", r"'rewards.py' is not FILE.py:NAME, module.path:NAME or "
                 r"handoff:NAME"),
    "missing module": ("no_such_module_xyz:f", r"module 'no_such_module_xyz' cannot be "
                       r"imported .*: install it, add its folder to PYTHONPATH"),
}


@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_a_spec_that_cannot_be_loaded_is_one_line(case):
    spec, pattern = SPEC_CASES[case]
    with pytest.raises(HandoffError, match=pattern) as e:
        RewardSet.from_config(RewardConfig(functions=[spec]), TASK)
    assert "\n" not in str(e.value)


def test_a_reward_file_that_raises_while_loading_is_named(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n\ndef f(**kw):\n    pass\n")
    with pytest.raises(HandoffError, match=r"broken.py' raised ModuleNotFoundError while "
                       r"loading \(No module named 'no_such_module_xyz'\): fix the file"):
        RewardSet.from_config(RewardConfig(functions=[f"{tmp_path}/broken.py:f"]), TASK)


def test_a_python_object_that_is_not_callable_is_refused():
    with pytest.raises(HandoffError, match=r"is a int, not callable"):
        RewardSet.from_config(RewardConfig(), TASK, callables=[3])


def test_weights_must_match_the_functions():
    with pytest.raises(HandoffError, match=r"reward.weights has 1 value\(s\) for 2 reward "
                       r"functions: give one weight per function"):
        RewardSet.from_config(RewardConfig(functions=["handoff:exact", "handoff:numeric"],
                                           weights=[1.0]), TASK)
    with pytest.raises(ConfigError, match=r"reward.weights\[1\]='nan' is not a finite number"):
        load_config(None, ["reward.functions=[handoff:exact,handoff:numeric]",
                           "reward.weights=[1,nan]"])
