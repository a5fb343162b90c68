"""`handoff plan` as a user meets it: no torch, fast, bad input -> one line and exit 2, and
the --json / --markdown forms (a run that does not fit: tests/plan/test_plan_does_not_fit.py)."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from handoff.cli import app
from handoff.plan.ledger import SWITCH_ACTIONS

runner = CliRunner()

NO_TORCH = """
import sys
import handoff.plan, handoff.plan.hardware, handoff.plan.shapes, handoff.plan.ledger
import handoff.plan.kvpool, handoff.plan.verdict, handoff.plan.report, handoff.plan.render
import handoff.cli
from handoff.cli import app
sys.argv = ["handoff", "plan", *sys.argv[1:], "--json"]
try:
    app()
except SystemExit as e:
    assert not e.code, e.code
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "transformers"))
assert not loaded, loaded
"""


@pytest.mark.parametrize("args, key, value", [
    (["--model", "qwen3-32b", "--gpus", "8"], ("model", "name"), "qwen3-32b"),
    (["--lora-rank", "16", "--model", "qwen3-8b", "--hardware", "h200"], ("lora", "rank"), 16),
], ids=["full", "lora"])
def test_plan_imports_no_torch(args, key, value):
    """What keeps `handoff plan` fast and laptop-friendly, with or without LoRA: no torch,
    triton or transformers is imported on its path (its speed is measured in docs/PERF.md,
    not asserted here)."""
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)[key[0]][key[1]] == value


def invoke(*args):
    return runner.invoke(app, ["plan", *args])


@pytest.mark.parametrize("args, cause, fix", [
    (["--util", "1.5"], "gpu_memory_utilization=1.5 is out of range", "(0, 1]"),
    (["--util", "-0.1"], "gpu_memory_utilization=-0.1 is out of range", "(0, 1]"),
    (["--model", "qwen3-999b"], "neither a preset", "use one of"),
    (["--gpus", "8", "--tp", "3"], "does not divide", "divisor"),
    (["--hardware", "tpu-v9"], "unknown hardware", "choose one of"),
    (["--gpus", "0"], "parallel.gpus=0", "[1"),
])
def test_bad_input_exits_2_with_one_line(args, cause, fix):
    res = invoke(*args)
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert cause in lines[0] and fix in lines[0]


def test_unreadable_config_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{oops")
    res = invoke("--model", str(tmp_path))
    assert res.exit_code == 2 and "cannot read" in res.output
    assert "valid HF config.json" in res.output


def test_json_shape():
    res = invoke("--model", "qwen3-32b", "--gpus", "8", "--step-seconds", "300", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert isinstance(r["model"]["params"], int) and r["model"]["params"] > 3e10
    assert set(r["memory"]["train"]) >= {"params", "grads", "optimizer", "reference"}
    assert set(r["memory"]["generate"]) >= {"engine_weights", "kv_pool", "activation_peak",
                                            "cuda_graph_pool"}
    assert all(isinstance(v, int) for v in r["memory"]["train"].values())
    sw = r["switch"]
    assert [a["name"] for a in sw["actions"]] == list(SWITCH_ACTIONS)
    for a in sw["actions"]:
        assert set(a) == {"name", "direction", "bytes_per_card", "link", "seconds", "note",
                          "exposed_seconds"}
        assert isinstance(a["bytes_per_card"], int)
    assert sw["total_bytes_per_card"] == sum(a["bytes_per_card"] for a in sw["actions"]
                                             if a["link"] == "PCIe")
    assert sw["share_of_step"] == pytest.approx(sw["total_seconds"] / 300)
    keys = {"utilization", "kv_pool_bytes", "concurrency", "decode_step_seconds",
            "tokens_per_second", "generation_seconds"}
    assert all(keys <= set(row) for row in r["kv"])
    assert [row["utilization"] for row in r["kv"] if row["requested"]] == [0.5]
    assert r["pinned_host_bytes_per_node"] == 8 * r["pinned_host_bytes_per_card"]
    assert set(r["verdict"]) >= {"fits", "mode", "max_utilization", "reasons"}
    assert r["layout"]["tp"] == 8 and r["layout"]["tp_auto"]


def test_markdown_and_rich_forms():
    md = invoke("--model", "qwen3-32b", "--gpus", "8", "--markdown")
    assert md.exit_code == 0
    for name in SWITCH_ACTIONS:
        assert f"| {name} |" in md.output
    assert "| 0.5 |" in md.output and "verdict: fits; mode colocate" in md.output
    rich = invoke("--model", "qwen3-32b", "--gpus", "8")
    assert rich.exit_code == 0 and "optimizer_d2h" in rich.output and "verdict" in rich.output


def test_flags_config_file_and_overrides(tmp_path):
    cfg = tmp_path / "plan.yaml"
    cfg.write_text("model:\n  path: llama3-8b\nparallel:\n  gpus: 16\n  tp: 2\n")
    res = invoke("--config", str(cfg), "rollout.gpu_memory_utilization=0.6", "--json")
    r = json.loads(res.stdout)
    assert r["model"]["name"] == "llama3-8b" and r["layout"]["gpus"] == 16
    assert r["layout"]["tp"] == 2 and not r["layout"]["tp_auto"]
    assert r["workload"]["utilization"] == 0.6
    # A flag overrides the file; a rate override changes the seconds, not the bytes.
    slow = json.loads(invoke("--config", str(cfg), "--gpus", "8", "--json").stdout)
    fast = json.loads(invoke("--config", str(cfg), "--gpus", "8", "--pcie-gbps", "50",
                             "--json").stdout)
    a, b = slow["switch"]["actions"][0], fast["switch"]["actions"][0]
    assert slow["layout"]["gpus"] == 8
    assert a["bytes_per_card"] == b["bytes_per_card"]
    assert b["seconds"] == pytest.approx(a["seconds"] / 2)
    off = json.loads(invoke("--model", "qwen3-32b", "--gpus", "64", "--no-optimizer-offload",
                            "--kl-coef", "0", "--json").output)
    acts = {x["name"]: x for x in off["switch"]["actions"]}
    assert acts["optimizer_d2h"]["bytes_per_card"] == 0 and acts["ref_h2d"]["bytes_per_card"] == 0
    assert off["memory"]["train"]["reference"] == 0
