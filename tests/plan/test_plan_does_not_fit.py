"""`handoff plan` on a run that does not fit: the whole plan, the verdict "does not fit" with
every reason, exit status 3, and advice that re-plans (checked here) to a plan that fits."""

import json

import pytest
from typer.testing import CliRunner

from handoff.cli import PLAN_DOES_NOT_FIT, app
from handoff.config import load_config
from handoff.plan.report import build_plan

runner = CliRunner()

CASES = {
    "8b-on-one-card": ["--model", "qwen3-8b", "--gpus", "1"],
    "32b-on-one-card": ["--model", "qwen3-32b", "--gpus", "1"],          # was: "raise --util"
    "util-too-low": ["--model", "qwen3-4b", "--gpus", "1", "--util", "0.1"],
    "32b-tp1": ["--model", "qwen3-32b", "--gpus", "8", "--tp", "1"],
    "70b-on-8": ["--model", "llama3-70b", "--gpus", "8"],
    "tp6-8-kv-heads": ["--model", "qwen3-8b", "--gpus", "6", "--tp", "6"],
    "optimizer-kept": ["--model", "qwen3-32b", "--gpus", "8", "--no-optimizer-offload"],
    "host-ram": ["--model", "qwen3-32b", "--gpus", "8", "--host-ram-gb", "512"],
}


def _plan(args):
    res = runner.invoke(app, ["plan", *args, "--json"])
    return res, json.loads(res.stdout) if res.stdout.strip().startswith("{") else None


@pytest.mark.parametrize("args", CASES.values(), ids=CASES.keys())
def test_json_gives_the_whole_plan_with_every_reason_and_advice_that_fits(args):
    res, report = _plan(args)
    assert res.exit_code == PLAN_DOES_NOT_FIT == 3, res.output
    assert {"memory", "switch", "kv", "verdict"} <= set(report)
    assert len(report["switch"]["actions"]) == 9 and report["kv"]
    v = report["verdict"]
    assert v["fits"] is False and v["mode"] is None
    failed = [r for r in v["reasons"] if r.startswith("does not fit")]
    assert failed and v["fix"].split("; it fits with")[0].endswith(failed[0])
    # The advice, taken as it is printed, re-plans to a plan that fits.
    assert v["advice"] is not None and f"it fits with {v['advice']['flags']}" in v["fix"]
    res2, again = _plan(args + v["advice"]["flags"].split())
    assert res2.exit_code == 0, res2.output
    assert again["verdict"]["fits"] and again["verdict"]["mode"] == v["advice"]["mode"]


def test_every_failed_limit_is_a_reason():
    v = _plan(CASES["32b-on-one-card"])[1]["verdict"]
    failed = [r for r in v["reasons"] if r.startswith("does not fit")]
    assert any("training state 524.2 GB" in r for r in failed)
    assert any("no KV pool at gpu_memory_utilization=0.5 (28.0 GB short)" in r for r in failed)


def test_an_engine_tp_that_does_not_divide_the_kv_heads_is_not_called_fits():
    v = _plan(CASES["tp6-8-kv-heads"])[1]["verdict"]
    assert "does not fit: engine TP 6 and the 8 KV heads do not divide one another" in v["reasons"]
    ok = _plan(["--model", "qwen3-8b", "--gpus", "8", "--tp", "8"])[1]["verdict"]
    assert ok["fits"]   # TP 8 divides the 8 KV heads and the 32 attention heads


@pytest.mark.parametrize("form", ["--markdown", None])
def test_the_tables_print_with_the_verdict_and_the_advice(form):
    res = runner.invoke(app, ["plan", *CASES["32b-on-one-card"], *([form] if form else [])],
                        terminal_width=200)
    assert res.exit_code == 3, res.output
    for words in ("engine_weights", "optimizer_d2h", "requested", "verdict: DOES NOT FIT",
                  "to fit: it fits with --gpus 8 --tp 2"):
        assert words in res.output


def test_no_fitting_plan_is_said_plainly():
    cfg = load_config(None, ["model.path=qwen3-8b", "hardware.hbm_gb=8"])
    v = build_plan(cfg, auto_tp_size=True)["verdict"]
    assert not v["fits"] and v["advice"] is None
    assert "no plan fits on up to 1024 cards" in v["fix"]


def test_train_preflight_still_refuses_a_plan_that_does_not_fit(tmp_path):
    from handoff.errors import HandoffError
    from handoff.modelzoo import build_byte_tokenizer
    from handoff.plan.shapes import PRESETS
    from handoff.preflight import preflight

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PRESETS["qwen3-32b"]))
    build_byte_tokenizer().save_pretrained(model)   # preflight renders its template
    header = b"{}"
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    cfg = load_config("examples/cpu-tiny.yaml", [f"model.path={model}", "hardware.name=h100-sxm",
                                                 f"run.out_dir={tmp_path / 'run'}",
                                                 "run.checkpoint=false", "model.dtype=bfloat16"])
    with pytest.raises(HandoffError, match="cannot fit: does not fit: training state.*it fits "
                                           "with --gpus 8"):
        preflight(cfg)
