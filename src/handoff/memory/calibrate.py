"""Measure the links the ledger prices, once at the start of a run.

    rates = measure_link_rates(torch.device("cuda"))   # {"d2h_bps", "h2d_bps", "d2d_bps"}
    remap = measure_remap_rates(device, pool_bytes, pool=region_pool)  # {"map_bps", ...}
    per_tensor = measure_tensor_host_seconds(device)   # host seconds per synced tensor

The planned-vs-measured table of a run feeds these rates (not a datasheet's) into the
ledger, so a gap between plan and measurement is the runtime's, not the hardware's. The
pinned buffer is allocated once here and freed (a run pays ~0.5 s per GiB to pin it).
Mapping a region is not linear in its size (an H200 maps 8 GiB in 0.5 ms and 100 GiB in
up to 281 ms), so the remap rates are measured at the size the run maps: its KV pool.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall seconds of `fn` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _wait(device)
        t0 = time.perf_counter()
        fn()
        _wait(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_link_rates(device: torch.device, nbytes: int = 256 << 20, repeats: int = 3) -> dict:
    """Bytes/s of a pinned D2H, a pinned H2D and a device-to-device copy (read + write)."""
    pin = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    other = torch.empty_like(dev)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=pin), device, repeats)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=pin), device, repeats)
    d2d = _timed(lambda: other.copy_(dev), device, repeats)
    del dev, host, other
    return {"d2h_bps": nbytes / d2h, "h2d_bps": nbytes / h2d, "d2d_bps": 2 * nbytes / d2d,
            "bytes": nbytes}


def _touched(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """`nbytes` of written memory (None for 0)."""
    return torch.ones(int(nbytes), dtype=torch.uint8, device=device) if nbytes > 0 else None


def measure_remap_rates(device: torch.device, nbytes: int, *, repeats: int = 3, pool=None,
                        tag: str = "calibrate", held_during_wake: int = 0,
                        freed_before_wake: Sequence[tuple[int, float]] = (),
                        settle_s: float = 0.0) -> dict:
    """Bytes/s of waking (map) and level-2 sleeping (unmap) one region of one `nbytes` tensor.

    Returns medians over `repeats` sleep/wake pairs after one warm-up pair:
    {"map_bps", "unmap_bps", "remap_bytes"}; remap_bytes is what a wake maps (the region's
    bytes, allocator granularity included). The region is left asleep, holding no memory:
    torch_memory_saver never returns a region's virtual reservation (its pools live as
    long as the process), which costs address space only. Pass the run's RegionPool as
    `pool` so its meter accounts for the region (asleep, it shows as nobody's bytes).

    A wake can be measured in the state a switch wakes in: `held_during_wake` bytes in use
    elsewhere, `freed_before_wake` = [(bytes, seconds before the wake)] of touched memory
    handed back to the driver at those times, and the region's own pages given `settle_s`
    after its sleep. It matters: the driver seems to clear freed pages before mapping them
    again (on the H200, mapping 100 GiB right after unmapping it took 281 ms, 32 GiB 1.3 ms;
    the 4B run's KV wake, which follows the optimizer's 48 GB going back, 79 ms).
    """
    from handoff.memory.regions import RegionPool, aggressive_empty_cache

    pool = pool if pool is not None else RegionPool(device)
    with pool.region(tag):
        block = torch.empty(int(nbytes), dtype=torch.uint8, device=pool.device)
    block.fill_(1)  # touch every page: a CPU region is only real once written
    pool.track(tag, block)
    del block  # the pool keeps its tracked tensor; nothing else may hold the memory
    remap_bytes = pool.region_bytes(tag)
    sleeps, wakes = [], []
    for _ in range(repeats + 1):
        _wait(pool.device)
        t0 = time.perf_counter()
        pool.sleep([tag], level=2)
        _wait(pool.device)
        sleeps.append(time.perf_counter() - t0)
        time.sleep(settle_s)
        held = _touched(held_during_wake, pool.device)
        releases = sorted(freed_before_wake, key=lambda r: -r[1])  # the earliest first
        blocks = [_touched(n, pool.device) for n, _ in releases]
        for i, (_, lead) in enumerate(releases):
            blocks[i] = None
            aggressive_empty_cache()  # the bytes go back to the driver, as in the switch
            time.sleep(max(lead - (releases[i + 1][1] if i + 1 < len(releases) else 0.0), 0.0))
        t1 = time.perf_counter()
        pool.wake_up([tag])
        _wait(pool.device)
        wakes.append(time.perf_counter() - t1)
        del held
    pool.sleep([tag], level=2)
    aggressive_empty_cache()
    tiny = 1e-9  # a CPU resize can be below the clock's resolution
    return {"map_bps": remap_bytes / max(statistics.median(wakes[1:]), tiny),
            "unmap_bps": remap_bytes / max(statistics.median(sleeps[1:]), tiny),
            "remap_bytes": remap_bytes}


def measure_tensor_host_seconds(device: torch.device, *, tensors: int = 256,
                                repeats: int = 3) -> float:
    """Median wall seconds of one tensor's host-side work in an in-process weight sync.

    Per tensor the sync (handoff.sync.weights and the engine's load_weights) copies the
    trainer's parameter, cuts a slot out of a flat bucket (slice + views) and copies into
    it; the engine then copies whole batches of slots into its weights with one
    `_foreach_copy_`. Timed here over `tensors` tiny tensors, where the copies cost nothing
    on the device, so what remains is the host's dispatch and launch cost, which the
    ledger charges once per tensor. Keep it in step with those two when they change.
    """
    srcs = [torch.randn(64, device=device) for _ in range(tensors)]
    dsts = [torch.empty_like(t) for t in srcs]
    flat = torch.empty(tensors * 64 * 4, dtype=torch.uint8, device=device)

    def one_sync() -> None:
        offset, slots = 0, []
        for src in srcs:
            full = src.clone()
            nbytes = full.numel() * full.element_size()
            slot = flat[offset:offset + nbytes].view(full.dtype).view(full.shape)
            slot.copy_(full)
            slots.append(slot)
            offset += nbytes
        torch._foreach_copy_(dsts, slots)

    return _timed(one_sync, device, repeats) / tensors
