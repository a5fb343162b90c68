"""The reward, eval and data keys parse from YAML and from `key=value` overrides."""

import pytest

from handoff.config import load_config
from handoff.errors import ConfigError


def test_reward_functions_parse_as_a_list_from_an_override():
    cfg = load_config(None, ["reward.functions=[a.py:f,b.py:g]", "reward.weights=[1,0.5]",
                             "reward.workers=2"])
    assert cfg.reward.functions == ["a.py:f", "b.py:g"]
    assert cfg.reward.weights == [1.0, 0.5] and cfg.reward.workers == 2
    single = load_config(None, ["reward.functions=handoff:numeric"])
    assert single.reward.functions == ["handoff:numeric"] and single.reward.weights is None


def test_reward_and_eval_keys_parse_from_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("reward:\n  functions: [rewards.py:accuracy, handoff:exact]\n"
                    "  weights: [2, 1]\n"
                    "data:\n  eval_path: eval.jsonl\n  split: validation\n"
                    "eval:\n  n: 16\nrun:\n  eval_every: 5\n")
    cfg = load_config(path)
    assert cfg.reward.functions == ["rewards.py:accuracy", "handoff:exact"]
    assert cfg.reward.weights == [2.0, 1.0]
    assert (cfg.data.eval_path, cfg.data.split, cfg.eval.n, cfg.run.eval_every) == (
        "eval.jsonl", "validation", 16, 5)
    assert cfg.eval.temperature == 0.0   # greedy by default


def test_a_list_of_the_wrong_items_is_refused_naming_the_item():
    with pytest.raises(ConfigError, match=r"reward.weights\[1\]='x' is not a number"):
        load_config(None, ["reward.weights=[1,x]"])
    with pytest.raises(ConfigError, match=r"reward.functions\[0\]=.* is not a string"):
        load_config(None, ["reward.functions=[[a]]"])
    with pytest.raises(ConfigError, match=r"reward.workers=-1 is out of range"):
        load_config(None, ["reward.workers=-1"])
