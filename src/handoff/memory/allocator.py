"""The allocator's knobs and the host's readings: empty the cache, expandable segments, the
frozen GC heap, host memory.

    aggressive_empty_cache()            # before a wake: cached segments back to the driver
    with expandable_segments(False):    # while regions map (torch_memory_saver needs it off)
        ...
    with frozen_gc_heap():              # a run's steps: gc skips the objects of its setup
        ...
    total, available = host_memory()
    free = device_free_bytes(device)    # what the card can still allocate (None on CPU)
    n = alloc_retries(device)           # times the cache was flushed to satisfy an allocation

Switch expandable_segments only through this module, so the recorded value and PyTorch's
agree.
"""

from __future__ import annotations

import contextlib
import gc
import os

import torch

_EXPANDABLE = {"enabled": "expandable_segments:true" in
               os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()}


def aggressive_empty_cache() -> None:
    """Collect garbage, wait for the device, and hand PyTorch's unused cached blocks back.

    Run it before waking a region: segments cached by the caching allocator are free to
    PyTorch but not to the driver, and a wake is checked against the driver's free memory.
    It waits for every copy in flight (and an arena offload's memory is freed only once its
    transfer is waited on), so with a copy running, skip it.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def frozen_gc_heap():
    """Run the block with every object alive at its start moved out of the collector's scans.

    A run keeps ~400K Python objects alive from setup (torch, transformers, the models), and
    each full gc.collect() would walk all of them, three times per switch back to rollout
    (docs/PERF.md). Setup garbage is collected first (frozen garbage would never be), and the
    heap is unfrozen at the end.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _set_allocator_settings(setting: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


def set_expandable_segments(enabled: bool) -> bool:
    """Switch PyTorch's expandable_segments at run time; returns the previous setting.

    Only new segments follow the setting. Without CUDA this records the value and does
    nothing else.
    """
    previous = _EXPANDABLE["enabled"]
    if torch.cuda.is_available():
        _set_allocator_settings(f"expandable_segments:{'True' if enabled else 'False'}")
    _EXPANDABLE["enabled"] = enabled
    return previous


@contextlib.contextmanager
def expandable_segments(enabled: bool):
    """Run a block with expandable_segments switched to `enabled`, then switch it back."""
    previous = set_expandable_segments(enabled)
    try:
        yield
    finally:
        set_expandable_segments(previous)


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take now: the driver's free memory plus the
    blocks PyTorch holds cached but unused. None off CUDA (there the "device" is host memory,
    which this does not ration)."""
    if device.type != "cuda":
        return None
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached_unused


def alloc_retries(device: torch.device) -> int:
    """How many allocations found the card full and had to flush torch's cache first (each
    a device sync and cudaFree calls; 0 off CUDA): a training phase that does so is short
    of memory, and pays for it in time."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this machine in bytes, or (0, 0) without /proc."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return 0, 0
    return info.get("MemTotal", 0), info.get("MemAvailable", 0)
