"""Where the in-process weight sync's time goes, at a preset model's real tensor sizes.

    python3 scripts/sync_breakdown.py --preset qwen3-4b   # on the device, after device-env.sh

The ledger prices the sync as the weights' map + the slower of its copies (at the measured
sync copy rate) and its host work (a per-tensor cost measured with tiny tensors). This runs
the real `sync_weights` over tensors of the preset's names and shapes (random bf16 sources,
separate destinations, a loader batching its copies as the engine's does) and splits its
time: the host's (until the last bucket is handed over), the device's (the copies alone, one
batched call), and the launches (torch.profiler: kernels and launch calls per sync). Each
case is timed idle and with a device-to-host copy queued on another stream, as the
optimizer's offload is during the switch. Prints one table; the numbers go to docs/PERF.md.
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from handoff.calibrate import measure_link_rates, measure_tensor_host_seconds
from handoff.plan.shapes import PRESETS
from handoff.rollout.weight_copy import copy_in_batches
from handoff.sync.weights import sync_weights


def meta_model(preset: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(PRESETS[preset])
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg),
                                                dtype=torch.bfloat16)


def loader(dests: dict, marks: list):
    def load(entries) -> None:
        def copies():
            for name, t in entries:
                d = dests[name]
                if tuple(t.shape) != tuple(d.shape):
                    raise AssertionError(name)
                yield d, t, d.numel() * d.element_size()

        copy_in_batches(copies())
        marks.append(time.perf_counter())
    return load


def in_flight(nbytes: int, chunk: torch.Tensor, host: torch.Tensor, stream) -> None:
    with torch.cuda.stream(stream):
        for _ in range(-(-nbytes // chunk.numel())):
            host.copy_(chunk, non_blocking=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--in-flight-gb", type=float, default=48.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = meta_model(args.preset)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    src = {n: torch.randn(s, device=dev, dtype=torch.bfloat16) for n, s in shapes}
    dst = {n: torch.empty(s, device=dev, dtype=torch.bfloat16) for n, s in shapes}
    nbytes = sum(t.numel() * 2 for t in src.values())
    chunk = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    copies = torch.cuda.Stream(dev)
    compute = torch.cuda.current_stream(dev)
    flight = int(args.in_flight_gb * 1e9)
    rows = []

    def run(label: str, fn, busy: bool) -> None:
        walls, hosts = [], []
        fn()
        torch.cuda.synchronize()
        for _ in range(args.repeats):
            if busy:
                in_flight(flight, chunk, host, copies)
            t0 = time.perf_counter()
            host_end = fn()
            compute.synchronize()
            walls.append(time.perf_counter() - t0)
            hosts.append((host_end or time.perf_counter()) - t0)
            torch.cuda.synchronize()
        rows.append((label + (" +D2H" if busy else ""), statistics.median(walls),
                     statistics.median(hosts)))

    def real_sync():
        marks = []
        sync_weights(((n, src[n]) for n, _ in shapes), loader(dst, marks),
                     bucket_bytes=args.bucket_mb << 20, device=dev)
        return marks[-1]

    def copies_only():
        torch._foreach_copy_(list(dst.values()), list(src.values()))
        torch._foreach_copy_(list(dst.values()), list(src.values()))

    slots = {n: torch.empty(s, device=dev, dtype=torch.bfloat16) for n, s in shapes}

    def per_tensor(copy):
        def fn():
            for n, _ in shapes:
                copy(slots[n], src[n])
                copy(dst[n], slots[n])
        return fn

    for busy in (False, True):
        run("sync, real sizes", real_sync, busy)
        run("2 x foreach copy, one call", copies_only, busy)
        run("2 x copy_ per tensor", per_tensor(lambda d, s: d.copy_(s)), busy)
        run("2 x foreach copy per tensor",
            per_tensor(lambda d, s: torch._foreach_copy_([d], [s])), busy)
    del slots

    # As in a switch: the destinations live in a region that slept (level 2) and is mapped
    # again right before the copies write it.
    from handoff.memory.regions import RegionPool
    pool = RegionPool(dev)
    with pool.region("weights"):
        woken = {n: torch.empty(s, device=dev, dtype=torch.bfloat16) for n, s in shapes}
    pool.track("weights", list(woken.values()))
    for busy in (False, True):
        walls, hosts, wakes = [], [], []
        for _ in range(args.repeats + 1):
            pool.sleep(["weights"], level=2)
            time.sleep(0.5)
            if busy:
                in_flight(flight, chunk, host, copies)
            t0 = time.perf_counter()
            pool.wake_up(["weights"])
            t1 = time.perf_counter()
            marks = []
            sync_weights(((n, src[n]) for n, _ in shapes), loader(woken, marks),
                         bucket_bytes=args.bucket_mb << 20, device=dev)
            walls.append(time.perf_counter() - t1)
            hosts.append(marks[-1] - t1)
            wakes.append(t1 - t0)
            torch.cuda.synchronize()
        rows.append(("sync into a just-woken region" + (" +D2H" if busy else ""),
                     statistics.median(walls[1:]), statistics.median(hosts[1:])))
        rows.append(("  its wake (map)" + (" +D2H" if busy else ""),
                     statistics.median(wakes[1:]), statistics.median(wakes[1:])))
    # What comes before the copies: the two buckets' allocation (the switch emptied the
    # cache, so it is a cudaMalloc), and a pageable 1 MB H2D (the RoPE table's restore
    # before the engine pinned its copy).
    table = torch.randn(1 << 18)
    rope = torch.empty(1 << 18, device=dev)
    for busy in (False, True):
        allocs, restores = [], []
        for _ in range(args.repeats):
            torch.cuda.empty_cache()
            if busy:
                in_flight(flight, chunk, host, copies)
            t0 = time.perf_counter()
            pair = [torch.empty(args.bucket_mb << 20, dtype=torch.uint8, device=dev)
                    for _ in range(2)]
            t1 = time.perf_counter()
            rope.copy_(table)
            allocs.append(t1 - t0)
            restores.append(time.perf_counter() - t1)
            del pair
            torch.cuda.synchronize()
        suffix = " +D2H" if busy else ""
        for label, times in (("2 buckets' cudaMalloc", allocs), ("1 MB pageable H2D", restores)):
            rows.append((label + suffix, statistics.median(times), statistics.median(times)))
    rates = measure_link_rates(dev)
    tiny = measure_tensor_host_seconds(dev, module=model)
    tiny_busy = measure_tensor_host_seconds(dev, module=model, d2h_in_flight_bytes=flight)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        real_sync()
        torch.cuda.synchronize()
    events = prof.events()
    launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                "cudaLaunchKernelExC")]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)

    n = len(shapes)
    print(f"{args.preset}: {n} tensors, {nbytes / 1e9:.2f} GB, bucket {args.bucket_mb} MiB")
    print(f"{'case':<36}{'wall ms':>10}{'host ms':>10}{'us/tensor':>11}")
    for label, wall, host_s in rows:
        print(f"{label:<36}{wall * 1e3:10.2f}{host_s * 1e3:10.2f}{host_s / n * 1e6:11.1f}")
    d2d = rates["d2d_bps"]
    print(f"copy_ D2D rate (calibrate) {d2d / 1e9:.0f} GB/s -> 2 copies {4 * nbytes / d2d * 1e3:.2f} ms")
    print(f"tiny-tensor calibration: {tiny * 1e6:.1f} us/tensor idle, "
          f"{tiny_busy * 1e6:.1f} us with D2H in flight -> {tiny_busy * n * 1e3:.2f} ms")
    print(f"profiled sync: {len(launches)} launch calls ({sum(e.cpu_time_total for e in launches) / 1e3:.2f}"
          f" ms host), {len(kernels)} kernels, {busy_us / 1e3:.2f} ms device busy")


if __name__ == "__main__":
    main()
