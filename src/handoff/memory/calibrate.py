"""Measure the links the ledger prices, once at the start of a run.

    rates = measure_link_rates(torch.device("cuda"))   # {"d2h_bps", "h2d_bps", "d2d_bps", ...}
    remap = measure_remap_rates(device, pool_bytes, pool=region_pool)   # {"map_bps", ...}
    per_tensor = measure_tensor_host_seconds(device, module=actor.module,
                                             d2h_in_flight_bytes=opt_bytes)
    copies = measure_sync_copy_bps(device, actor.full_params, bucket_bytes=512 << 20)

The planned-vs-measured table of a run feeds these rates (not a datasheet's) into the
ledger, so a gap between plan and measurement is the runtime's, not the hardware's. The
pinned buffer is allocated once here and freed (a run pays ~0.5 s per GiB to pin it).
Mapping a region is not linear in its size (an H200 maps 8 GiB in 0.5 ms and 100 GiB in
up to 281 ms), so the remap rates are measured at the size the run maps: its KV pool.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from handoff.memory.host_copy import copy_from_host
from handoff.sync.weights import WeightIter, copy_in_batches, sync_weights


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
    """Bytes/s of a pinned D2H, a pinned H2D and a device-to-device copy (read + write);
    on CUDA also "h2d_kernel_bps", the H2D done by a kernel (handoff.memory.host_copy), as
    the copies right after the engine's sleep are."""
    pin = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    other = torch.empty_like(dev)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=pin), device, repeats)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=pin), device, repeats)
    d2d = _timed(lambda: other.copy_(dev), device, repeats)
    rates = {"d2h_bps": nbytes / d2h, "h2d_bps": nbytes / h2d, "d2d_bps": 2 * nbytes / d2d,
             "bytes": nbytes}
    if pin:
        rates["h2d_kernel_bps"] = nbytes / _timed(lambda: copy_from_host(dev, host), device,
                                                  repeats)
    del dev, host, other
    return rates


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
    the 4B run's KV wake, which follows the optimizer's 48 GB going back, 79 ms). Likewise
    each sleep comes `settle_s` after the wake, the region written in between, as a step's
    pool sleeps after the rollout (an unmap right after the map ran at 1.4 TB/s where the
    4B run's sleeps ran at 2.1).
    """
    from handoff.memory.regions import RegionPool, aggressive_empty_cache

    pool = pool if pool is not None else RegionPool(device)
    with pool.region(tag):
        block = torch.empty(int(nbytes), dtype=torch.uint8, device=pool.device)
    block.fill_(1)  # touch every page: a CPU region is only real once written
    pool.track(tag, block)
    remap_bytes = pool.region_bytes(tag)
    sleeps, wakes = [], []
    for repeat in range(repeats + 1):
        if repeat:
            block.fill_(1)
            _wait(pool.device)
            time.sleep(settle_s)
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
    del block
    aggressive_empty_cache()
    tiny = 1e-9  # a CPU resize can be below the clock's resolution
    return {"map_bps": remap_bytes / max(statistics.median(wakes[1:]), tiny),
            "unmap_bps": remap_bytes / max(statistics.median(sleeps[1:]), tiny),
            "remap_bytes": remap_bytes}


def _engine_like_loader(plan: dict):
    """A load_weights doing per tensor what the engine's does: a name lookup (`plan`: name ->
    (destination, expected shape, bytes)), a shape check, a touched-set entry, and the
    engine's batched copies (copy_in_batches)."""
    def load(entries) -> None:
        touched = set()

        def copies():
            for name, t in entries:
                dest, expected, nbytes = plan[name]
                if tuple(t.shape) != expected:
                    raise AssertionError(name)
                touched.add(name)
                yield dest, t, nbytes

        copy_in_batches(copies())
    return load


def measure_sync_copy_bps(device: torch.device, params: Callable[[], WeightIter], *,
                          bucket_bytes: int, budget_bytes: int = 8 << 30,
                          repeats: int = 3) -> dict:
    """Bytes read + written per second by an in-process weight sync's copies, measured on
    the trainer's own tensors: {"sync_copy_bps", "sync_sample_bytes"}.

    Runs the real `sync_weights` over `params()` (what the worker syncs, e.g. the actor's
    full_params) into scratch destinations through _engine_like_loader. Its copies are
    a kernel per tensor into the bucket and a batched one out of it: many small kernels,
    slower per byte than one large copy (d2d_bps), so the ledger prices them at this rate.
    At most `budget_bytes` of tensors take part (every k-th, so the sample keeps the
    model's mix of sizes; on CUDA no more than fits, {} when nothing does). The cache is
    emptied before each sync: its two buckets are allocated inside the timed sync, as in a
    step's switch.
    """
    if device.type == "cuda":   # the sample's destinations and the buckets must fit
        budget_bytes = min(budget_bytes, torch.cuda.mem_get_info(device)[0]
                           - 2 * bucket_bytes - (1 << 30))
    if budget_bytes <= 0:
        return {}
    # One walk for the sizes (under FSDP each walk all-gathers every tensor).
    metas = [(name, tuple(t.shape), t.dtype, t.numel() * t.element_size())
             for name, t in params()]
    stride = max(-(-sum(m[3] for m in metas) // budget_bytes), 1)
    plan = {name: (torch.empty(shape, dtype=dtype, device=device), shape, nbytes)
            for i, (name, shape, dtype, nbytes) in enumerate(metas) if i % stride == 0}
    load = _engine_like_loader(plan)
    sample = sum(nbytes for _, _, nbytes in plan.values())

    times = []
    for _ in range(repeats + 1):   # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _wait(device)
        t0 = time.perf_counter()
        sync_weights(((n, t) for n, t in params() if n in plan), load,
                     bucket_bytes=bucket_bytes, device=device)
        _wait(device)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:])
    del plan, load
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # Into the bucket and out of it, each a read and a write.
    return {"sync_copy_bps": 4 * sample / max(seconds, 1e-9), "sync_sample_bytes": sample}


def measure_tensor_host_seconds(device: torch.device, *, module: torch.nn.Module | None = None,
                                tensors: int = 256, repeats: int = 3,
                                d2h_in_flight_bytes: int = 0, chunk_bytes: int = 64 << 20,
                                per_bucket: int = 25) -> float:
    """Median wall seconds of one tensor's host-side work in an in-process weight sync.

    Runs the real `sync_weights` with tiny tensors, `per_bucket` to a bucket (a 4B model's
    ~400 tensors fill 16 buckets of 512 MiB). The tensors come from walking `module`'s
    parameters as the actor's full_params does (the module tree, each parameter's local
    tensor detached; `tensors` made-up names without a module), and go into a loader that
    does per tensor what the engine's load_weights does (_engine_like_loader). The copies
    cost nothing on the device here, so what remains is the host's dispatch and launch
    cost, which the ledger charges once per tensor.

    d2h_in_flight_bytes: time it while a device-to-host copy of that many bytes (in the
    pinned arena's chunks) is queued on another stream, as the optimizer's offload is during
    the switch's sync: launches then wait behind the queued copies.
    """
    names = ([name for name, _ in module.named_parameters()] if module is not None
             else [f"w{i}" for i in range(tensors)])
    tensors = len(names)
    tiny = [torch.randn(64, device=device) for _ in names]
    plan = {name: (torch.empty_like(t), (64,), 256) for name, t in zip(names, tiny)}

    def walk():
        if module is None:
            yield from ((name, t.detach()) for name, t in zip(names, tiny))
            return
        for (name, p), t in zip(module.named_parameters(), tiny):
            getattr(p, "_local_tensor", p).detach()   # full_params' work per parameter
            yield name, t

    load = _engine_like_loader(plan)

    def one_sync() -> None:
        sync_weights(walk(), load, bucket_bytes=per_bucket * 64 * 4, device=device)

    if not d2h_in_flight_bytes or device.type != "cuda":
        return _timed(one_sync, device, repeats) / tensors
    chunk = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
    copies = torch.cuda.Stream(device)
    one_sync()
    _wait(device)
    with torch.cuda.stream(copies):
        for _ in range(-(-d2h_in_flight_bytes // chunk_bytes)):
            host.copy_(chunk, non_blocking=True)
    compute = torch.cuda.current_stream(device)
    times = []
    for _ in range(repeats):   # all of them while the copies are still queued
        t0 = time.perf_counter()
        one_sync()
        compute.synchronize()
        times.append(time.perf_counter() - t0)
    _wait(device)
    return sorted(times)[len(times) // 2] / tensors
