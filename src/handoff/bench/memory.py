"""`handoff bench memory`: the memory runtime's moves, timed against their floors.

    handoff bench memory --out bench-memory.json            # CUDA: >= 4 GiB sets, 30 GiB KV
    handoff bench memory --size-gib 0.05 --kv-gib 0.1       # CPU smoke run (flagged "cpu")

Measures, in one process:
* the pinned copy rate (plain tensor.copy_ of one big tensor, D2H and H2D): the floor;
* PinnedArena offload/onload of a set of that size (acceptance: >= 90% of the floor);
* D2H of one set and H2D of another at the same time vs one after the other;
* sleep and wake of a `kv_cache` region (acceptance: each <= 50 ms for 30 GiB);
* level-1 sleep/wake through our arena vs torch_memory_saver's own CPU backup
  (acceptance: >= 10x faster), each split into the first call (host memory gets pinned)
  and the steady state.
On CPU the same code runs at the sizes given; rates are memcpy rates and the
torch_memory_saver comparison is skipped.
"""

from __future__ import annotations

import statistics
import time

import torch

from handoff.memory.staging import PinnedArena

from handoff.memory.regions import RegionPool

from handoff.memory.allocator import aggressive_empty_cache

GiB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    """Wall seconds of fn() including the device work it queued."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _raw_copy(device: torch.device, nbytes: int, repeats: int) -> dict:
    """Best-of-N rate of one plain copy_ of nbytes each way (pinned host when CUDA)."""
    pin = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    d2h = [_timed(lambda: host.copy_(dev, non_blocking=pin), device) for _ in range(repeats)]
    h2d = [_timed(lambda: dev.copy_(host, non_blocking=pin), device) for _ in range(repeats)]
    del dev, host
    return {"d2h_gbps": nbytes / min(d2h) / 1e9, "h2d_gbps": nbytes / min(h2d) / 1e9}


def _param_like_set(device: torch.device, nbytes: int, num: int = 32) -> list[torch.Tensor]:
    """num bf16 tensors totalling nbytes, like a model's parameters."""
    each = nbytes // num // 2
    return [torch.full((each,), float(i), dtype=torch.bfloat16, device=device)
            for i in range(num)]


def _arena(device: torch.device, nbytes: int, repeats: int, raw: dict) -> dict:
    arena = PinnedArena(pin=device.type == "cuda")
    a, b = _param_like_set(device, nbytes), _param_like_set(device, nbytes)
    t0 = time.perf_counter()
    arena.stage("a", a)
    arena.stage("b", b)
    stage_s = time.perf_counter() - t0
    d2h, h2d, wall_d2h, wall_h2d = [], [], [], []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        t = arena.offload("a")
        t.wait()
        wall_d2h.append(time.perf_counter() - t0)
        d2h.append(t.seconds)
        t0 = time.perf_counter()
        t = arena.onload("a")
        t.wait()
        wall_h2d.append(time.perf_counter() - t0)
        h2d.append(t.seconds)
    set_bytes = arena.set_bytes("a")
    arena.offload("b").wait()
    together, apart = [], []
    for _ in range(repeats):
        # a is on the device, b on the host: move a down while b comes up, then swap back
        together.append(_timed(lambda: [t.wait() for t in (arena.offload("a"),
                                                         arena.onload("b"))], device))
        apart.append(_timed(lambda: (arena.offload("b").wait(), arena.onload("a").wait()),
                            device))
    out = {
        "set_bytes": set_bytes,
        "stage_seconds_first": stage_s,
        "d2h_gbps": set_bytes / min(d2h) / 1e9,
        "h2d_gbps": set_bytes / min(h2d) / 1e9,
        "d2h_wall_gbps": set_bytes / min(wall_d2h) / 1e9,
        "h2d_wall_gbps": set_bytes / min(wall_h2d) / 1e9,
        "together_seconds": _median(together),
        "sequence_seconds": _median(apart),
        "together_total_gbps": 2 * set_bytes / _median(together) / 1e9,
        "sequence_total_gbps": 2 * set_bytes / _median(apart) / 1e9,
    }
    out["d2h_vs_raw"] = out["d2h_gbps"] / raw["d2h_gbps"]
    out["h2d_vs_raw"] = out["h2d_gbps"] / raw["h2d_gbps"]
    arena.onload("b").wait()
    del a, b
    arena.close()
    return out


def _kv_sleep_wake(device: torch.device, nbytes: int, repeats: int) -> dict:
    pool = RegionPool(device)
    with pool.region("kv_cache"):
        kv = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pool.track("kv_cache", [kv])
    kv.fill_(0)  # touch it so it is resident before the first sleep
    sleeps, wakes = [], []
    for _ in range(repeats):
        sleeps.append(_timed(lambda: pool.sleep(["kv_cache"], level=2), device))
        wakes.append(_timed(lambda: pool.wake_up(["kv_cache"]), device))
    region = pool.region_bytes("kv_cache")
    pool.sleep(level=2)
    return {"region_bytes": region, "sleep_ms": 1e3 * _median(sleeps),
            "wake_ms": 1e3 * _median(wakes), "sleep_ms_max": 1e3 * max(sleeps),
            "wake_ms_max": 1e3 * max(wakes)}


def _level1_ours(device: torch.device, nbytes: int, repeats: int) -> dict:
    pool = RegionPool(device)
    with pool.region("weights"):
        w = _param_like_set(device, nbytes)
    pool.track("weights", w)
    first_sleep = _timed(lambda: pool.sleep(level=1), device)
    first_wake = _timed(pool.wake_up, device)
    sleeps, wakes = [], []
    for _ in range(repeats):
        sleeps.append(_timed(lambda: pool.sleep(level=1), device))
        wakes.append(_timed(pool.wake_up, device))
    ok = all(bool((t == float(i)).all()) for i, t in enumerate(w))
    pool.sleep(level=2)
    pool.arena.close()
    return {"bytes": pool.tracked_bytes("weights"), "first_sleep_s": first_sleep,
            "first_wake_s": first_wake, "sleep_s": _median(sleeps), "wake_s": _median(wakes),
            "contents_exact": ok}


def _level1_tms(device: torch.device, nbytes: int, repeats: int) -> dict:
    from handoff.memory.tms_backend import _saver

    saver = _saver()
    tag = "handoff-bench:cpu-backup"
    with torch.cuda.device(device), saver.region(tag=tag, enable_cpu_backup=True):
        w = _param_like_set(device, nbytes)
    first_sleep = _timed(lambda: saver.pause(tag), device)
    first_wake = _timed(lambda: saver.resume(tag), device)
    sleeps, wakes = [], []
    for _ in range(repeats):
        sleeps.append(_timed(lambda: saver.pause(tag), device))
        wakes.append(_timed(lambda: saver.resume(tag), device))
    ok = all(bool((t == float(i)).all()) for i, t in enumerate(w))
    saver.pause(tag)  # its pool lives as long as the process: leave it unmapped
    cdll = saver._impl._binary_wrapper.cdll
    return {"cpu_backup_backend": cdll.tms_get_cpu_backup_backend().decode(),
            "retain_cpu_backup": bool(saver.retain_cpu_backup), "first_sleep_s": first_sleep, "first_wake_s": first_wake,
            "sleep_s": _median(sleeps), "wake_s": _median(wakes), "contents_exact": ok}


def run_memory_bench(*, size_gib: float = 4.0, kv_gib: float = 30.0, repeats: int = 5,
                     device: str = "auto") -> dict:
    """Run every measurement; returns a JSON-ready dict (see module docstring)."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    nbytes, kv_bytes = int(size_gib * GiB), int(kv_gib * GiB)
    result: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "backend": dev.type, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "size_bytes": nbytes, "kv_bytes": kv_bytes, "repeats": repeats,
    }
    aggressive_empty_cache()
    result["raw"] = _raw_copy(dev, nbytes, repeats)
    aggressive_empty_cache()
    result["arena"] = _arena(dev, nbytes, repeats, result["raw"])
    aggressive_empty_cache()
    result["kv_cache"] = _kv_sleep_wake(dev, kv_bytes, repeats)
    aggressive_empty_cache()
    result["level1_ours"] = _level1_ours(dev, nbytes, repeats)
    if dev.type == "cuda":
        aggressive_empty_cache()
        result["level1_tms"] = _level1_tms(dev, nbytes, repeats)
        ours, theirs = result["level1_ours"], result["level1_tms"]
        result["level1_speedup_first"] = theirs["first_sleep_s"] / ours["first_sleep_s"]
        result["level1_speedup_steady"] = theirs["sleep_s"] / ours["sleep_s"]
    result["checks"] = _checks(result)
    return result


def _checks(r: dict) -> dict:
    """The issue's acceptance lines, as pass/fail (meaningful on CUDA at full size)."""
    arena, kv = r["arena"], r["kv_cache"]
    checks = {
        "arena D2H >= 90% of raw": arena["d2h_vs_raw"] >= 0.9,
        "arena H2D >= 90% of raw": arena["h2d_vs_raw"] >= 0.9,
        "D2H + H2D together faster than in sequence":
            arena["together_seconds"] < arena["sequence_seconds"],
        "kv_cache sleep <= 50 ms": kv["sleep_ms"] <= 50,
        "kv_cache wake <= 50 ms": kv["wake_ms"] <= 50,
        "level-1 contents exact": r["level1_ours"]["contents_exact"],
    }
    if "level1_speedup_steady" in r:
        checks["level-1 sleep >= 10x torch_memory_saver's (steady)"] = \
            r["level1_speedup_steady"] >= 10
        checks["level-1 sleep >= 10x torch_memory_saver's (first)"] = \
            r["level1_speedup_first"] >= 10
    return checks


def render(r: dict, console) -> None:
    """Print the result as a rich table."""
    from rich.table import Table

    raw, arena, kv, ours = r["raw"], r["arena"], r["kv_cache"], r["level1_ours"]
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    flag = "" if r["backend"] == "cuda" else "  [CPU: memcpy rates, not PCIe]"
    table = Table(title=f"handoff bench memory on {r['device']} ({r['date']}){flag}")
    for col in ("measurement", "value", "compared to"):
        table.add_column(col)
    table.add_row(f"pinned copy_ D2H / H2D ({gib(r['size_bytes'])})",
                  f"{raw['d2h_gbps']:.1f} / {raw['h2d_gbps']:.1f} GB/s", "floor of this run")
    table.add_row(f"arena offload / onload ({gib(arena['set_bytes'])}, 32 tensors)",
                  f"{arena['d2h_gbps']:.1f} / {arena['h2d_gbps']:.1f} GB/s",
                  f"{arena['d2h_vs_raw']:.0%} / {arena['h2d_vs_raw']:.0%} of floor (>= 90%)")
    table.add_row("arena D2H + H2D together / in sequence",
                  f"{arena['together_total_gbps']:.1f} / {arena['sequence_total_gbps']:.1f} GB/s",
                  f"{arena['sequence_seconds'] / arena['together_seconds']:.2f}x")
    table.add_row("arena first stage() (host pinning)", f"{arena['stage_seconds_first']:.2f} s",
                  "once per process")
    table.add_row(f"kv_cache sleep / wake ({gib(kv['region_bytes'])})",
                  f"{kv['sleep_ms']:.1f} / {kv['wake_ms']:.1f} ms", "<= 50 ms each")
    table.add_row(f"level-1 sleep / wake, ours ({gib(ours['bytes'])}), steady",
                  f"{ours['sleep_s'] * 1e3:.0f} / {ours['wake_s'] * 1e3:.0f} ms",
                  f"first: {ours['first_sleep_s']:.2f} / {ours['first_wake_s']:.2f} s")
    if "level1_tms" in r:
        tms = r["level1_tms"]
        table.add_row("level-1 sleep / wake, torch_memory_saver cpu backup, steady",
                      f"{tms['sleep_s'] * 1e3:.0f} / {tms['wake_s'] * 1e3:.0f} ms",
                      f"first: {tms['first_sleep_s']:.2f} / {tms['first_wake_s']:.2f} s")
        table.add_row("level-1 sleep speedup, steady / first",
                      f"{r['level1_speedup_steady']:.1f}x / {r['level1_speedup_first']:.1f}x",
                      ">= 10x")
    console.print(table)
    for name, ok in r["checks"].items():
        console.print(f"  {'[green]pass[/]' if ok else '[red]FAIL[/]'}  {name}")
