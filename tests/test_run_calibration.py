"""A run prices its ledger with rates measured in it, and reports the time a save took."""

import json

import pytest

from handoff.config import load_config
from handoff.loop import Trainer
from handoff.modelzoo import init_model
from handoff.plan.shapes import load_shape
from handoff.run_report import planned_actions

RATES = {"d2h_bps": 5e9, "h2d_bps": 5e9, "d2d_bps": 20e9, "map_bps": 40e9, "unmap_bps": 80e9,
         "tensor_host_s": 2e-5, "sync_copy_bps": 1000e9}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("calib-model"), dtype="float32")


def _cfg(model, out_dir, *extra):
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                   f"run.out_dir={out_dir}", *extra])


def test_planned_actions_move_with_the_measured_rates(tmp_path):
    cfg = _cfg("qwen3-4b", tmp_path)
    pool = 100e9
    base = planned_actions(cfg, RATES, pool)
    slower_map = planned_actions(cfg, {**RATES, "map_bps": RATES["map_bps"] / 2}, pool)
    assert slower_map["kv_cache_wake"]["seconds"] == pytest.approx(
        2 * base["kv_cache_wake"]["seconds"])
    assert base["kv_cache_wake"]["seconds"] == pytest.approx(pool / RATES["map_bps"])
    # The sync maps the engine's weights too, so it moves by their bytes / the map rate.
    weights = base["engine_weights_sync"]["bytes"]
    assert slower_map["engine_weights_sync"]["seconds"] == pytest.approx(
        base["engine_weights_sync"]["seconds"] + weights / RATES["map_bps"])
    assert slower_map["engine_sleep"] == base["engine_sleep"]
    slower_unmap = planned_actions(cfg, {**RATES, "unmap_bps": RATES["unmap_bps"] / 4}, pool)
    assert slower_unmap["engine_sleep"]["seconds"] == pytest.approx(
        4 * base["engine_sleep"]["seconds"])
    assert base["engine_sleep"]["seconds"] == pytest.approx((weights + pool) / RATES["unmap_bps"])
    # Host and copies overlap: the copies set the sync's time until the host is slower.
    tensors = load_shape("qwen3-4b").num_tensors
    copies = 4 * weights / RATES["sync_copy_bps"]   # one dtype: into the bucket and out
    assert tensors * RATES["tensor_host_s"] < copies
    slower_copies = planned_actions(cfg, {**RATES, "sync_copy_bps": 500e9}, pool)
    assert slower_copies["engine_weights_sync"]["seconds"] == pytest.approx(
        base["engine_weights_sync"]["seconds"] + copies)
    slower_host = planned_actions(cfg, {**RATES, "tensor_host_s": 5e-4}, pool)
    assert tensors * 5e-4 > copies
    assert slower_host["engine_weights_sync"]["seconds"] == pytest.approx(
        base["engine_weights_sync"]["seconds"] - copies + tensors * 5e-4)
    # Measured at the weights' own size, the sync's map uses that rate; the KV wake does not.
    own = planned_actions(cfg, {**RATES, "weights_map_bps": RATES["map_bps"] * 10}, pool)
    assert own["engine_weights_sync"]["seconds"] == pytest.approx(
        base["engine_weights_sync"]["seconds"] - 0.9 * weights / RATES["map_bps"])
    assert own["kv_cache_wake"] == base["kv_cache_wake"]
    # A measured kernel H2D rate prices the two copies that follow the engine's sleep.
    kernel = planned_actions(cfg, {**RATES, "h2d_kernel_bps": RATES["h2d_bps"] / 2}, pool)
    for name in ("params_h2d", "ref_h2d"):
        assert kernel[name]["seconds"] == pytest.approx(2 * base[name]["seconds"])
    assert kernel["optimizer_h2d"] == base["optimizer_h2d"]
    # The run's sync is in-process: no per-bucket IPC charge, whatever the profile says.
    ipc_heavy = _cfg("qwen3-4b", tmp_path, "hardware.sync_bucket_ms=1000")
    assert planned_actions(ipc_heavy, RATES, pool) == base


def test_a_run_measures_its_start_rates_and_times_its_saves(model_dir, tmp_path):
    trainer = Trainer(_cfg(model_dir, tmp_path, "run.steps=2"))
    rates = trainer.worker.start_rates
    # Calibrated at the size the KV wake maps: the pool the engine then took.
    assert rates["remap_bytes"] == trainer.worker.engine.stats()["kv_cache_bytes"]
    assert rates["map_bps"] > 0 and rates["unmap_bps"] > 0
    # ... and at the size of the weights the sync wakes (the engine pads its flat buffer;
    # the RoPE table shares their region).
    engine = trainer.worker.engine
    assert rates["weights_remap_bytes"] == pytest.approx(
        engine.pool.region_bytes("weights") - engine.model.rope_cos_sin.nbytes, rel=0.01)
    assert rates["weights_map_bps"] > 0
    saved = trainer.step(0, save=True)
    assert saved["timing_s/checkpoint"] > 0
    assert saved["timing_s/checkpoint"] < saved["timing_s/step"]
    assert trainer.step(1)["timing_s/checkpoint"] == 0.0
    trainer.report.start(0)
    trainer.report.log_step(saved)
    summary = trainer.report.finish()
    for key in ("map_bps", "unmap_bps", "remap_bytes", "weights_map_bps", "tensor_host_s",
                "sync_copy_bps", "sync_sample_bytes"):
        assert summary["rates"][key] > 0
    assert "unmap" in (tmp_path / "summary.md").read_text()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["timing_s/checkpoint"] == saved["timing_s/checkpoint"]
