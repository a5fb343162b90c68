"""RewardSet scores a step's samples with TRL-style, verl-style, TRL's own and built-in
rewards: the values equal what the functions return, called as their frameworks call them."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from handoff.config import RewardConfig
from handoff.errors import HandoffError
from handoff.rewards import RewardSet, Sample, style_of
from handoff.tasks import ArithmeticTask, Problem

FIXTURES = Path(__file__).parent / "fixtures"
TASK = ArithmeticTask(seed=0)


def _fixture(name: str):
    spec = importlib.util.spec_from_file_location(f"direct_{name}", FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problem(index: int, reference: str = "42", **columns) -> Problem:
    return Problem(messages=({"role": "user", "content": f"question {index}"},), answer=reference,
                   index=index, metadata={"columns": columns})


def _samples(texts, *, chat=False, **columns_per_sample) -> list[Sample]:
    out = []
    for i, text in enumerate(texts):
        columns = {k: v[i] for k, v in columns_per_sample.items()}
        problem = _problem(i, **columns)
        prompt = list(problem.messages) if chat else problem.prompt
        out.append(Sample(problem, prompt, text, list(range(len(text)))))
    return out


def _rewards(*functions, weights=None, workers=0, callables=()) -> RewardSet:
    specs = [f if f.startswith(("handoff:", "trl.")) else f"{FIXTURES}/{f}" for f in functions]
    return RewardSet.from_config(RewardConfig(functions=specs, weights=weights, workers=workers),
                                 TASK, callables=callables)


TEXTS = ["#### 42", "the answer is 41", "<think>hm</think> 42", "x" * 25]


def test_a_trl_file_gets_plain_completions_and_its_values_are_the_totals():
    scored = _rewards("trl_rewards.py:reward_len").score(_samples(TEXTS))
    expected = _fixture("trl_rewards").reward_len(completions=TEXTS)
    assert list(scored.per_function["reward_len"]) == expected
    assert list(scored.totals) == expected
    assert scored.correct == (None,) * 4   # no grader among the rewards


def test_a_reward_file_imports_a_module_beside_it(tmp_path, monkeypatch):
    """`from helpers import score` in a reward file in another folder loads the helpers
    beside it (a reward worker loads the file through the same `_load_file`)."""
    folder = tmp_path / "my_rewards"
    folder.mkdir()
    (folder / "score_helpers.py").write_text(
        "def score(text):\n    return float(len(text))\n")
    (folder / "main.py").write_text(
        "from score_helpers import score\n\n"
        "def by_length(completions, **kwargs):\n    return [score(c) for c in completions]\n")
    monkeypatch.setattr(sys, "path", list(sys.path))   # the folder added is undone after
    rewards = RewardSet.from_config(RewardConfig(functions=[f"{folder}/main.py:by_length"]),
                                    TASK)
    try:
        scored = rewards.score(_samples(TEXTS))
    finally:
        rewards.close()
    assert list(scored.totals) == [float(len(t)) for t in TEXTS]


def _reward_folder(root: Path, name: str, helper_value: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "shared_helper.py").write_text(f"def score(text):\n    return {helper_value}\n")
    (folder / f"{name}_reward.py").write_text(
        "from shared_helper import score\n\n"
        "def r(completions, **kwargs):\n    return [score(c) for c in completions]\n")
    return folder


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_two_reward_files_whose_helpers_share_a_name_are_refused(tmp_path, monkeypatch, order):
    """Each file's `from shared_helper import score` would get whichever folder's helper came
    first (one module per name): refused in one line naming the module, not scored with the
    other's (found by a tester: both functions scored with the first one's helper)."""
    folders = [_reward_folder(tmp_path, "first", "1.0"), _reward_folder(tmp_path, "second", "7.0")]
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    specs = [f"{folders[i]}/{folders[i].name}_reward.py:r" for i in order]
    with pytest.raises(HandoffError, match=r"both have a module named 'shared_helper'.*Rename "):
        RewardSet.from_config(RewardConfig(functions=specs), TASK)


def test_a_helper_found_first_on_the_path_is_refused_whatever_the_order(tmp_path, monkeypatch):
    """The second folder already on sys.path (a driver script there, or PYTHONPATH): the
    first file imports that folder's helper before the second is loaded; still refused
    (a reviewer's find: the check ran against the folders known so far only)."""
    first = _reward_folder(tmp_path, "first", "1.0")
    second = _reward_folder(tmp_path, "second", "7.0")
    monkeypatch.setattr(sys, "path", [str(second), *sys.path])
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    specs = [f"{first}/first_reward.py:r", f"{second}/second_reward.py:r"]
    with pytest.raises(HandoffError, match=r"both have a module named 'shared_helper'"):
        RewardSet.from_config(RewardConfig(functions=specs), TASK)


def test_two_reward_files_of_one_folder_share_its_helper(tmp_path, monkeypatch):
    folder = _reward_folder(tmp_path, "only", "3.0")
    (folder / "again.py").write_text((folder / "only_reward.py").read_text())
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    rewards = RewardSet.from_config(RewardConfig(
        functions=[f"{folder}/only_reward.py:r", f"{folder}/again.py:r"]), TASK)
    try:
        scored = rewards.score(_samples(TEXTS))
    finally:
        rewards.close()
    assert list(scored.totals) == [6.0] * len(TEXTS)


def test_an_async_trl_function_is_awaited():
    scored = _rewards("trl_rewards.py:async_reward_len").score(_samples(TEXTS))
    assert list(scored.totals) == _fixture("trl_rewards").reward_len(completions=TEXTS)


def test_chat_prompts_give_trl_functions_assistant_messages():
    scored = _rewards("trl_rewards.py:format_reward").score(_samples(TEXTS, chat=True))
    assert scored.per_function["format_reward"] == (0.0, 0.0, 1.0, 0.0)


def test_dataset_columns_and_the_trainer_state_reach_a_trl_function():
    samples = _samples(["ab", "abcd", "a"], difficulty=[1, 2, 3])
    scored = _rewards("trl_rewards.py:weighted_by_difficulty").score(samples, step=7,
                                                                     max_steps=10)
    assert scored.totals == (1 * 2 + 7, 2 * 4 + 7, 3 * 1 + 7)


def test_a_verl_file_is_called_per_sample_with_verls_keywords():
    samples = _samples(["work #### 7", "#### 8", "#### 7"],
                       data_source=["openai/gsm8k", "other", "openai/gsm8k"],
                       reward_model=[{"ground_truth": "7"}, {"ground_truth": "8"},
                                     {"ground_truth": "9"}],
                       extra_info=[{"bonus": 0.5}, {}, None])
    scored = _rewards("verl_score.py:compute_score", "verl_score.py:length_score").score(samples)
    assert scored.per_function["compute_score"] == (1.5, 1.0, 0.0)
    assert scored.per_function["length_score"] == (2.0 * 11, 1.0 * 6, 2.0 * 6)


def test_an_async_verl_function_is_awaited_as_an_async_trl_one_is():
    samples = _samples(["work #### 7", "#### 8"], data_source=["openai/gsm8k", "other"],
                       reward_model=[{"ground_truth": "7"}, {"ground_truth": "9"}],
                       extra_info=[{"bonus": 0.5}, {}])
    scored = _rewards("verl_score.py:async_compute_score").score(samples)
    assert scored.totals == _rewards("verl_score.py:compute_score").score(samples).totals
    assert scored.totals == (1.5, 0.0)


def test_a_step_every_function_leaves_unscored_warns_once_and_scores_zero():
    import warnings

    from handoff.rewards.reward_set import RewardWarning

    def none_for_all(completions, **kwargs):
        return [None] * len(completions)

    def none_for_some(completions, **kwargs):
        return [None, 1.0] + [None] * (len(completions) - 2)

    rewards = _rewards(callables=[none_for_all])
    with pytest.warns(RewardWarning, match=r"every reward function \(none_for_all\) returned "
                                           r"None for every sample"):
        assert rewards.score(_samples(TEXTS)).totals == (0.0,) * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewardWarning)
        rewards.score(_samples(TEXTS))                                    # once a run
        _rewards(callables=[none_for_some]).score(_samples(TEXTS))        # one sample scored


def test_verl_ground_truth_is_none_for_prompts_without_answers():
    seen = []

    def judge(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(ground_truth)
        return 0.5

    samples = [Sample(_problem(0, reference=""), "q", "anything", [1])]   # answer_field=null
    assert _rewards(callables=[judge]).score(samples).totals == (0.5,) and seen == [None]


def test_verl_ground_truth_falls_back_to_the_tasks_answer():
    samples = [Sample(_problem(0, reference="5"), "q", "#### 5", [1])]
    assert _rewards("verl_score.py:compute_score").score(samples).totals == (1.0,)


def test_trls_own_rewards_by_module_spec_and_as_a_callable_object():
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    overlong = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=10)
    samples = _samples(TEXTS, chat=True)
    scored = _rewards("trl.rewards.format_rewards:think_format_reward",
                      callables=[overlong]).score(samples)
    completions = [[{"role": "assistant", "content": t}] for t in TEXTS]
    ids = [list(range(len(t))) for t in TEXTS]
    assert list(scored.per_function["think_format_reward"]) == think_format_reward(completions)
    assert list(scored.per_function["soft_overlong_punishment_reward"]) == overlong(ids)
    assert scored.per_function["soft_overlong_punishment_reward"] != (0.0,) * 4


def test_a_builtin_and_a_user_reward_mix_as_a_weighted_sum():
    scored = _rewards("handoff:numeric", "trl_rewards.py:reward_len",
                      weights=[2.0, 0.5]).score(_samples(TEXTS))
    numeric = scored.per_function["numeric"]
    length = scored.per_function["reward_len"]
    assert numeric == (1.0, 0.0, 1.0, 0.0)   # "#### 42" and a last number 42 are right
    assert scored.totals == tuple(2.0 * n + 0.5 * r for n, r in zip(numeric, length))
    assert scored.correct == (True, False, True, False)
    assert scored.formatted == (True, False, False, False)
    row = scored.metrics_row()
    assert row["accuracy"] == 0.5 and row["format_rate"] == 0.25
    assert row["reward/reward_len"] == sum(length) / 4
    assert row["timing_s/reward"] == scored.seconds > 0


def test_none_is_skipped_and_a_sample_without_any_reward_totals_zero():
    samples = _samples(["42", "it is 42", "7"], answer=[42, None, None])
    scored = _rewards("trl_rewards.py:answer_in_completion", "verl_score.py:length_score",
                      weights=[3.0, 1.0]).score(samples)
    assert scored.per_function["answer_in_completion"] == (1.0, None, None)
    assert scored.totals == (3.0 * 1.0 + 2.0, 8.0, 1.0)
    assert scored.unscorable == (False, False, False)
    alone = _rewards("trl_rewards.py:answer_in_completion").score(samples)
    assert alone.totals == (1.0, 0.0, 0.0) and alone.unscorable == (False, True, True)
    assert alone.metrics_row()["reward/answer_in_completion"] == 1.0   # over the scored one


def test_without_functions_the_tasks_grader_gives_exactly_task_reward():
    task = ArithmeticTask(digits=2, ops="+-*", seed=3)
    problems = task.sample(6)
    texts = ["", "12", "1 + 2 = 3", "The answer is 5", "99.", f"{problems[0].answer}"]
    samples = [Sample(p, p.prompt, t, [1, 2]) for p in problems for t in texts]
    scored = RewardSet.from_config(RewardConfig(), task).score(samples)
    expected = [float(task.reward(s.problem, s.completion)) for s in samples]
    assert list(scored.totals) == expected
    assert any(expected) and scored.per_function.keys() == {"task"}
    assert scored.correct == tuple(task.score(s.problem, s.completion).correct for s in samples)


def test_log_extra_and_log_metric_are_collected():
    scored = _rewards("trl_rewards.py:logs_what_it_saw").score(_samples(["a", "abc"]))
    assert scored.extra_columns == {"length": [1, 3]}
    assert scored.logged == {"mean_length": 2.0}
    assert scored.metrics_row()["mean_length"] == 2.0


@pytest.mark.slow   # spawns two workers, each importing transformers for trainer_state
def test_a_pool_of_two_workers_gives_the_values_in_process_gives():
    specs = ("trl_rewards.py:reward_len", "verl_score.py:compute_score",
             "trl.rewards.format_rewards:think_format_reward", "handoff:exact")
    samples = _samples(TEXTS * 3, chat=True, reward_model=[{"ground_truth": "42"}] * 12)
    alone = _rewards(*specs, weights=[1.0, 2.0, 3.0, 4.0]).score(samples)
    with _rewards(*specs, weights=[1.0, 2.0, 3.0, 4.0], workers=2) as pooled_set:
        pooled = pooled_set.score(samples)
        again = pooled_set.score(samples[:3])     # the pool is reused, and fewer samples fit
    assert pooled.per_function == alone.per_function
    assert pooled.totals == alone.totals and len(set(alone.totals)) > 1
    assert again.totals == alone.totals[:3]


def test_two_functions_of_one_name_are_logged_apart():
    rewards = _rewards("trl_rewards.py:reward_len", "trl_rewards.py:reward_len")
    assert rewards.names == ["reward_len", "reward_len_2"]


def test_the_style_is_read_from_the_parameter_names():
    verl, trl = _fixture("verl_score"), _fixture("trl_rewards")
    assert style_of(verl.compute_score) == style_of(verl.length_score) == "verl"
    assert style_of(trl.reward_len) == style_of(trl.weighted_by_difficulty) == "trl"
    assert style_of(lambda **kw: [0.0]) == "trl" and style_of(math.sqrt) == "trl"


@pytest.mark.parametrize("chat", [False, True])
def test_prompts_reach_trl_functions_as_the_model_saw_them(chat):
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.append(prompts)
        return [0.0] * len(prompts)

    samples = _samples(["a"], chat=chat)
    _rewards(callables=[spy]).score(samples)
    assert seen == [[samples[0].prompt]]
