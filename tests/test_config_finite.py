"""Every numeric config field refuses NaN and infinity (the list is walked from the dataclass
tree, so a field added later is covered), from YAML and from key=value overrides; and the
cross-field checks a run's inputs need: an out_dir, room for a prompt, resume xor overwrite."""

import dataclasses
import types
import typing

import pytest

from handoff.config import Config, load_config
from handoff.errors import ConfigError


def _numeric_fields(cls: type = Config, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _numeric_fields(tp, f"{prefix}{f.name}.")
            continue
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if tp in (int, float):
            keys.append(f"{prefix}{f.name}")
    return keys


NUMERIC = _numeric_fields()


def test_the_walk_finds_the_numeric_fields():
    # A walk that found nothing would make the test below pass vacuously.
    assert len(NUMERIC) > 40
    assert {"actor.lr", "rollout.n", "hardware.pinned_pcie_gbps", "run.seed"} <= set(NUMERIC)


@pytest.mark.parametrize("key", NUMERIC)
def test_non_finite_values_are_refused_by_yaml_and_override(key, tmp_path):
    *sections, name = key.split(".")   # actor.lora.rank: a section within a section
    nesting = "".join(f"{'  ' * i}{section}:\n" for i, section in enumerate(sections))
    for text in (".nan", ".inf", "-.inf"):   # YAML's own spellings parse to floats
        path = tmp_path / "c.yaml"
        path.write_text(f"{nesting}{'  ' * len(sections)}{name}: {text}\n")
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert key in str(e.value) and "not a finite number" in str(e.value), str(e.value)
    for text in ("nan", "inf", "-inf", "NaN", "1e999"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}={text}"])
        assert key in str(e.value) and "not a finite number" in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", NUMERIC)
def test_a_boolean_is_not_taken_for_a_number(key):
    # float(True) is 1.0: actor.kl_coef=true meant to turn KL on would train with 1.0
    for text in ("true", "false"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}={text}"])
        assert key in str(e.value) and ("boolean" in str(e.value)
                                        or "not an integer" in str(e.value)), str(e.value)
    with pytest.raises(ConfigError, match="is a boolean, not a number"):
        load_config(None, ["reward.weights=[true]"])


def test_a_non_finite_value_set_in_code_is_refused_by_validate():
    from handoff.config import validate

    cfg = Config()
    cfg.actor.lr = float("nan")
    with pytest.raises(ConfigError, match=r"actor.lr=nan is not a finite number: pass a value "
                                          r"in \(0, 1\]"):
        validate(cfg)


@pytest.mark.parametrize("override, words", [
    (["run.out_dir="], "run.out_dir is empty"),
    (["run.out_dir=null"], "run.out_dir is empty"),
    (["rollout.max_tokens=64", "rollout.max_model_len=64"], "leaves no room for a prompt"),
    (["run.resume=true", "run.overwrite=true"], "pick one"),
    (["workload.max_response_len=1"], r"workload.max_response_len=1 \(--max-response-len\) "
     "is below the mean response length"),
    (["run.steps=2", "actor.updates_per_step=2", "actor.warmup_steps=5"],
     r"actor.warmup_steps=5 is longer than the run's 4 optimizer steps"),
    (["run.loggers=[tensorboard,neptune]"], "run.loggers\\[1\\]='neptune' is not accepted: choose one "
     "of tensorboard, wandb, mlflow"),
])
def test_cross_field_inputs_are_refused(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, override)


@pytest.mark.parametrize("example", ["cpu-demo", "cpu-tiny", "h200-4b"])
def test_the_examples_still_validate(example):
    load_config(f"examples/{example}.yaml")
