"""actor.compile=auto: priced by the planner (compile seconds against the steps' saving),
off on CPU, decided once in the run plan and shown by `handoff plan`."""

import pytest

from handoff.config import load_config
from handoff.plan.compile import (COLD_COMPILE_SECONDS, COMPILED_TRAIN_SAVING,
                                  WARM_COMPILE_SECONDS, price_compile)
from handoff.plan.render import summary_lines
from handoff.plan.report import build_plan
from handoff.runplan import RunPlan


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Warm marks read from this test's cache only; torch's cache variable restored after."""
    monkeypatch.setenv("HANDOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("HANDOFF_COMPILE_CACHE", raising=False)


def _price(steps, *, device_type="cuda", hardware="h200", warm=False, requested="auto",
           train_s=8.7):
    return price_compile(requested, device_type=device_type, hardware=hardware,
                         train_seconds_per_step=train_s, steps=steps, warm=warm)


def test_auto_is_off_on_cpu_whatever_the_steps():
    choice = _price(10**6, device_type="cpu")
    assert not choice.on and "CPU" in choice.reason
    # A GPU run priced without a GPU profile has nothing to weigh the compile against.
    no_profile = _price(10**6, hardware="cpu")
    assert not no_profile.on and "hardware.name" in no_profile.reason


def test_auto_turns_on_when_the_steps_repay_the_compile():
    per_step = 8.7 * COMPILED_TRAIN_SAVING
    enough = int(COLD_COMPILE_SECONDS / per_step) + 1
    on, off = _price(enough), _price(enough - 1)
    assert on.on and not off.on
    assert on.saving_seconds == pytest.approx(enough * per_step)
    assert on.compile_seconds == off.compile_seconds == COLD_COMPILE_SECONDS
    # The reason states the sum it decided by.
    assert f"{enough - 1} step(s)" in off.reason and "<=" in off.reason
    assert f"{COLD_COMPILE_SECONDS:.0f} s to compile" in off.reason


def test_a_warm_cache_is_repaid_by_fewer_steps():
    steps = int(COLD_COMPILE_SECONDS / (8.7 * COMPILED_TRAIN_SAVING))   # short of a cold start
    assert WARM_COMPILE_SECONDS < steps * 8.7 * COMPILED_TRAIN_SAVING
    assert not _price(steps).on
    warm = _price(steps, warm=True)
    assert warm.on and warm.compile_seconds == WARM_COMPILE_SECONDS and "cache" in warm.reason


@pytest.mark.parametrize("requested", [True, False])
def test_a_boolean_is_kept_as_given(requested):
    for device_type in ("cpu", "cuda"):
        choice = _price(1, device_type=device_type, requested=requested)
        assert choice.on is requested and choice.reason == f"actor.compile={str(requested).lower()}"


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("true", True), ("false", False)])
def test_the_config_takes_auto_or_a_boolean(text, value):
    assert load_config(None, [f"actor.compile={text}"]).actor.compile == value
    assert load_config(None).actor.compile == "auto"


def test_a_compile_setting_that_is_not_auto_or_a_boolean_is_one_line():
    from handoff.errors import HandoffError

    with pytest.raises(HandoffError, match=r"actor.compile='maybe' is not a boolean"):
        load_config(None, ["actor.compile=maybe"])


def _h200_4b(*extra):
    return load_config("examples/h200-4b.yaml", ["model.path=qwen3-4b", *extra])


def test_the_run_plan_resolves_auto_once_for_the_device():
    short, long = RunPlan.build(_h200_4b()), RunPlan.build(_h200_4b("run.steps=200"))
    assert not short.compile.on and "4 step(s)" in short.compile.reason
    assert long.compile.on
    assert long.actor_config(device_type="cuda")[0].compile is True
    # The same config on a CPU device: off, priced for the device the run got.
    cpu_cfg, _ = long.actor_config(device_type="cpu")
    assert cpu_cfg.compile is False and "CPU" in long.compile_on("cpu").reason
    assert short.actor_config(device_type="cuda")[0].compile is False


def test_the_cpu_demo_resolves_to_eager():
    plan = RunPlan.build(load_config("examples/cpu-tiny.yaml", ["model.path=qwen3-4b"]))
    cfg, _ = plan.actor_config()
    assert cfg.compile is False and "CPU" in plan.compile.reason


def test_handoff_plan_shows_the_decision():
    report = build_plan(_h200_4b("run.steps=200"), advise=False)
    assert report["compile"]["on"] and report["compile"]["requested"] == "auto"
    line = next(x for x in summary_lines(report) if x.startswith("compiled layers"))
    assert line.startswith("compiled layers: on (auto: 200 step(s)")
    warm = build_plan(_h200_4b("run.steps=200"), advise=False, compile_warm=True)
    assert warm["compile"]["compile_seconds"] == WARM_COMPILE_SECONDS


@pytest.mark.parametrize("lora", [False, True])
def test_the_modelled_step_trains_at_the_compiled_rate_when_compile_is_on(lora):
    extra = ["actor.lora.rank=16"] if lora else []
    if lora:
        from handoff.plan.lora_report import build_lora_plan as build
    else:
        build = build_plan
    eager = build(_h200_4b("actor.compile=false", *extra), advise=False)
    compiled = build(_h200_4b("actor.compile=true", *extra), advise=False)
    assert compiled["compile"]["on"] and not eager["compile"]["on"]
    e, c = eager["step"], compiled["step"]
    assert c["train_flops_per_card"] == e["train_flops_per_card"]
    assert c["train_flops_per_s"] == pytest.approx(e["train_flops_per_s"]
                                                   / (1 - COMPILED_TRAIN_SAVING))
    # Less compute to hide the copies behind can expose more of them; the step is shorter.
    assert c["modelled_seconds"] < e["modelled_seconds"]
    assert c["modelled_seconds"] - c["switch_seconds"] == pytest.approx(
        e["modelled_seconds"] - e["switch_seconds"] - COMPILED_TRAIN_SAVING * e["train_seconds"])


@pytest.mark.parametrize("lora", [False, True])
def test_handoff_plan_prices_the_compile_on_the_step_it_models(lora):
    """The plan's step trains the workload's tokens (here 8x the run's): the compile's saving
    per step is that step's training times the saving, not the run's smaller step's."""
    if lora:
        from handoff.plan.lora_report import build_lora_plan as build
    else:
        build = build_plan
    extra = ["actor.lora.rank=16"] if lora else []
    base = _h200_4b("run.steps=6", *extra)
    tokens = build(base, advise=False)["step"]["train_tokens_per_card"]
    big = build(_h200_4b("run.steps=6", f"workload.tokens_per_step={8 * int(tokens)}", *extra),
                advise=False)
    step, choice = big["step"], big["compile"]
    assert step["train_tokens_per_card"] > 7 * tokens
    eager_train_s = step["train_seconds"] / (1 - COMPILED_TRAIN_SAVING if choice["on"] else 1)
    assert choice["saving_seconds"] == pytest.approx(6 * eager_train_s * COMPILED_TRAIN_SAVING)
    assert f"{step['train_tokens_per_card']:,.0f} tokens" in choice["reason"]
