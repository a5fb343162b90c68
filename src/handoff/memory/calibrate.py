"""Measure the links the ledger prices, once at the start of a run.

    rates = measure_link_rates(torch.device("cuda"))   # {"d2h_bps", "h2d_bps", "d2d_bps"}

The planned-vs-measured table of a run feeds these rates (not a datasheet's) into the
ledger, so a gap between plan and measurement is the runtime's, not the hardware's. The
pinned buffer is allocated once here and freed (a run pays ~0.5 s per GiB to pin it).
"""

from __future__ import annotations

import time

import torch


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall seconds of `fn` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
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
