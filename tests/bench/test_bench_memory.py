"""`handoff bench memory` runs end to end on CPU at a tiny size and writes its JSON."""

import json

from typer.testing import CliRunner

from handoff.cli import app


def test_bench_memory_cpu_tiny(tmp_path):
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "memory", "--device", "cpu", "--size-gib", "0.004",
                                   "--kv-gib", "0.008", "--repeats", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "CPU" in res.output and "kv_cache sleep" in res.output
    r = json.loads(out.read_text())
    assert r["backend"] == "cpu" and "level1_tms" not in r
    assert r["arena"]["set_bytes"] == 32 * (int(0.004 * (1 << 30)) // 32 // 2) * 2
    assert r["kv_cache"]["region_bytes"] == int(0.008 * (1 << 30))
    assert r["raw"]["d2h_gbps"] > 0 and r["arena"]["together_seconds"] > 0
    assert r["checks"]["level-1 contents exact"] is True
