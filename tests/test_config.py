from pathlib import Path

import pytest

from handoff.config import Config, load_config
from handoff.errors import ConfigError


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.rollout.gpu_memory_utilization == 0.5


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  n: 8\n  temperature: 0.7\nactor:\n  lr: 2.0e-5\n")
    cfg = load_config(p, ["rollout.n=16", "memory.param_offload=false", "parallel.shard_size=null"])
    assert cfg.rollout.n == 16
    assert cfg.rollout.temperature == 0.7
    assert cfg.actor.lr == 2e-5
    assert cfg.memory.param_offload is False
    assert cfg.parallel.shard_size is None


def test_list_fields_take_a_yaml_list_or_one_item(tmp_path):
    assert load_config().run.loggers == ["tensorboard"]
    assert load_config(None, ["run.loggers=[tensorboard,wandb]"]).run.loggers == [
        "tensorboard", "wandb"]
    assert load_config(None, ["run.loggers=mlflow"]).run.loggers == ["mlflow"]
    assert load_config(None, ["run.loggers=[]"]).run.loggers == []
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  loggers: [wandb, mlflow]\n")
    assert load_config(p).run.loggers == ["wandb", "mlflow"]


@pytest.mark.parametrize("override, words", [
    (["rollout.gpu_memory_utilization=1.5"], ["rollout.gpu_memory_utilization=1.5", "(0", "1]"]),
    (["rollout.gpu_memory_utilization=-0.1"], ["out of range"]),
    (["rollout.n=0"], ["rollout.n=0", "[2"]),
    (["rollout.n=2.5"], ["not an integer"]),
    (["rollout.kv_dtype=int4"], ["choose one of", "fp8"]),
    (["rollout.nope=1"], ["unknown config key", "rollout.nope"]),
    (["rollout.n"], ["not key=value"]),
    (["parallel.gpus=8", "parallel.tp=3"], ["does not divide"]),
])
def test_bad_values_name_field_and_range(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    for w in words:
        assert w in str(e.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)



@pytest.mark.parametrize("example", sorted(Path("examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads(example):
    load_config(example)


def test_a_config_line_names_the_real_cause(tmp_path):
    """A directory given as the config file, and a section given a scalar, are named as such."""
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"^actor must be a mapping of keys, got 3"):
        load_config(None, ["actor=3"])


def test_a_home_relative_path_in_yaml_is_expanded(tmp_path, monkeypatch):
    # a shell expands ~ on a command line, YAML does not: out_dir: ~/runs made a "~" directory
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  out_dir: ~/runs/demo\ndata:\n  eval_path: ~/eval.jsonl\n"
                    "  ops: '~'\n")
    cfg = load_config(path)
    assert cfg.run.out_dir == str(tmp_path / "home" / "runs" / "demo")
    assert cfg.data.eval_path == str(tmp_path / "home" / "eval.jsonl")
    assert cfg.data.ops == "~"   # not a path: kept as written
    assert load_config(None, ["model.path=~/m"]).model.path == str(tmp_path / "home" / "m")


def test_a_group_of_one_sample_is_refused():
    # GRPO's advantage is relative to the group: with rollout.n=1 every update was zero
    with pytest.raises(ConfigError, match=r"^rollout.n=1 is out of range \[2, inf\): .*a group "
                                          "of one learns nothing"):
        load_config(None, ["rollout.n=1"])
    assert load_config(None, ["rollout.n=2"]).rollout.n == 2


def test_lora_target_modules_are_a_set_in_one_order():
    # peft adapts the model's modules in its own order: these are one adapter, one checkpoint
    for listed in ("[v_proj,q_proj]", "[q_proj,v_proj]", "[v_proj,q_proj,q_proj]"):
        cfg = load_config(None, [f"actor.lora.target_modules={listed}"])
        assert cfg.actor.lora.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match=r"target_modules\[1\]='x_proj' is not accepted"):
        load_config(None, ["actor.lora.target_modules=[v_proj,x_proj]"])


@pytest.mark.parametrize("override, use", [
    ("actor.gradient_checkpointing=maybe", "use true, false or auto$"),
    ("actor.compile=maybe", "use true, false or auto$"),
    ("actor.micro_batch_tokens=many", "use a whole number such as 4 or auto$"),
    ("memory.param_offload=maybe", "use true or false$"),
])
def test_a_bad_value_of_a_key_that_takes_auto_names_auto(override, use):
    with pytest.raises(ConfigError, match=use):
        load_config(None, [override])
