"""MemoryMeter on CPU: probe contents, JSON lines, PNG, and the wake error quoting it."""

import json

import pytest
import torch

from handoff.errors import HandoffError
from handoff.memory.staging import PinnedArena
from handoff.memory.regions import RegionPool
from handoff.memory.meter import MemoryMeter, owners


def _setup():
    arena = PinnedArena()
    pool = RegionPool("cpu")
    meter = MemoryMeter("cpu", pool=pool, arena=arena)
    pool.meter = meter
    weights, kv = torch.randn(1 << 16), torch.zeros(1 << 18)
    pool.track("weights", [weights])
    pool.track("kv_cache", [kv])
    return arena, pool, meter


def test_probe_records_regions_staging_and_extras():
    arena, pool, meter = _setup()
    assert meter.last is None
    first = meter.probe("engine up", step=0)
    assert first["regions"] == {"weights": 1 << 18, "kv_cache": 1 << 20}
    assert first["awake"] == {"weights": True, "kv_cache": True}
    assert first["regions_awake"] == (1 << 18) + (1 << 20)
    assert first["step"] == 0 and first["device"] == "cpu"
    assert first["allocated"] > 0 and first["driver_total"] >= first["driver_free"] > 0
    pool.sleep(["kv_cache"], level=2)
    arena.stage("optim", [torch.randn(1000)])
    pool.sleep(["weights"], level=1)          # the pool's own arena counts too
    second = meter.probe("engine asleep")
    assert second["awake"] == {"weights": False, "kv_cache": False}
    assert second["regions_awake"] == 0
    assert second["pinned_staged"] == arena.bytes_staged() + pool.arena.bytes_staged()
    assert second["pinned_staged"] >= 4000 + (1 << 18)
    assert second["wall"] >= first["wall"]
    assert meter.last is second and len(meter.timeline) == 2


def test_owners_split_adds_up_on_cpu():
    _, pool, meter = _setup()
    record = meter.probe("x")
    parts = owners(record)
    assert parts["region weights"] == 1 << 18
    assert sum(parts.values()) == max(record["reserved"], record["regions_awake"])


def test_jsonl_and_png_written(tmp_path):
    _, pool, meter = _setup()
    meter.probe("start")
    pool.sleep(level=2)
    meter.probe("sleep")
    pool.wake_up(["weights"])
    meter.probe("wake weights")
    lines = meter.write_jsonl(tmp_path / "sub" / "memory.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["name"] for r in records] == ["start", "sleep", "wake weights"]
    assert records[2]["awake"] == {"weights": True, "kv_cache": False}
    png = meter.plot(tmp_path / "memory.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_wake_error_quotes_last_probe(monkeypatch):
    _, pool, meter = _setup()
    pool.sleep(level=2)
    meter.probe("before wake kv")
    monkeypatch.setattr(pool._backend, "free_bytes", lambda: 12345)
    with pytest.raises(HandoffError, match="at probe 'before wake kv'.*allocated"):
        pool.wake_up(["kv_cache"])
