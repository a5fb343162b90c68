"""What waits behind a large set's copies on the copy engines, and what does not?

    python3 scripts/compute_beside_copies.py           # on the device, after device-env.sh
    CUDA_DEVICE_MAX_CONNECTIONS=32 python3 scripts/compute_beside_copies.py

In the streamed switch the work beside the copies ran slower by about the copies' own time
(the update +0.84 s beside the optimizer's 0.875 s copy back: docs/PERF.md, "The streamed
switch"), with no wait for a copy counted. This times, with a 12 GB set queued through the
arena on its copy stream in each direction, against the same on an idle card:
* compute-stream work: bf16 GEMMs alone; micro-batch-like steps (inputs uploaded pageable,
  or pinned through `host_copy.upload`, GEMMs, a `.item()`);
* launch-bound work (thousands of tiny kernels: the host's pace, not the GPU's), in case
  the copy engines' reads of pinned host memory slow the host down;
* allocating a 48 GB storage (expandable segments on, as in training), idle and while GEMMs
  run (the optimizer's storage is allocated when its copy back is queued);
* a step's results read back (a few KB): by a copy, and by `host_copy.results_to_host`;
* a device-to-device copy (`copy_`, as FSDP2 unshards at world size 1), beside each set.
Run it with the environment variable above too: if the compute stream shared a hardware
queue with the copy stream (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), its launches would
wait behind the queued copies, whatever the inputs.
"""

import os
import statistics
import time

import torch

from handoff.memory.allocator import set_expandable_segments
from handoff.memory.host_copy import results_to_host, upload
from handoff.memory.staging import PinnedArena

GB = 1 << 30


def work(a: torch.Tensor, steps: int, *, inputs: str) -> float:
    """Wall seconds of `steps` units of compute-stream work; inputs: none, pageable, pinned
    (GEMMs with an upload and a readback each), or launches (100 tiny kernels a unit)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = torch.arange(4096)
    if inputs == "launches":
        small = torch.zeros(256, device=a.device)
        for _ in range(steps * 100):
            small.add_(1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    for _ in range(steps):
        if inputs == "pageable":
            host.to(a.device)                           # a micro-batch's inputs
        elif inputs == "pinned":
            upload(host, a.device)
        for _ in range(4):
            a @ a
        if inputs != "none":
            (a[0, 0] * 0).item()                        # a readback that syncs the host
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def readbacks(by_kernel: bool, k: int = 8) -> list[float]:
    """Milliseconds per results readback of 256 rows, as the engine does after a step."""
    tokens_B = torch.arange(256, device="cuda")
    logprobs_B = torch.zeros(256, device="cuda")
    tokens = torch.empty(256, dtype=torch.int64, pin_memory=True)
    logprobs = torch.empty(256, dtype=torch.float32, pin_memory=True)
    lat = []
    for _ in range(k):
        t = time.perf_counter()
        if by_kernel:
            results_to_host(tokens, logprobs, tokens_B, logprobs_B)
        else:
            tokens.copy_(tokens_B, non_blocking=True)
            logprobs.copy_(logprobs_B, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        ready.synchronize()
        lat.append((time.perf_counter() - t) * 1e3)
    return lat


def main() -> None:
    dev = torch.device("cuda:0")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    arena = PinnedArena()
    data = torch.zeros(12 * GB // 4, dtype=torch.float32, device=dev)
    arena.stage("set", [data])
    arena.offload("set", free_device=False).wait()     # the host copy valid both ways
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "(unset)")
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={connections}")

    def queued(direction: str):
        return (arena.onload("set") if direction == "h2d"
                else arena.offload("set", free_device=False))

    for inputs in ("none", "pageable", "pinned", "launches"):
        work(a, 20, inputs=inputs)                     # warm-up
        idle = work(a, 60, inputs=inputs)
        for direction in ("h2d", "d2h"):
            copy = queued(direction)
            beside = work(a, 60, inputs=inputs)
            copy.wait()
            print(f"steps, inputs {inputs:8s} beside {direction}: {beside:.3f} s, idle "
                  f"{idle:.3f} s (+{beside - idle:.3f} s; the copy {copy.seconds:.3f} s)")
    set_expandable_segments(True)
    for beside_gemms in (False, True):
        storage = torch.empty(0, dtype=torch.uint8, device=dev).untyped_storage()
        torch.cuda.synchronize()
        if beside_gemms:
            for _ in range(200):
                a @ a                                   # ~1.3 s of queued compute
        t0 = time.perf_counter()
        storage.resize_(48 * 10**9)
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        print(f"allocating 48 GB {'beside GEMMs' if beside_gemms else 'on an idle card'}: "
              f"{host_s * 1e3:.1f} ms of host")
        storage.resize_(0)
        torch.cuda.empty_cache()
    set_expandable_segments(False)
    src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for direction in ("none", "h2d", "d2h"):
        dst.copy_(src)
        torch.cuda.synchronize()
        copy = None if direction == "none" else queued(direction)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        d2d_ms = (time.perf_counter() - t0) * 1e3
        if copy is not None:
            copy.wait()
        print(f"256 MB device-to-device copy_ beside {direction}: {d2d_ms:.2f} ms")
    for by_kernel in (False, True):
        readbacks(by_kernel)
        idle = statistics.median(readbacks(by_kernel))
        copy = queued("d2h")
        lat = readbacks(by_kernel)
        copy.wait()
        print(f"results readback {'by kernel' if by_kernel else 'by copy  '}: idle {idle:.3f} "
              f"ms; beside d2h first {lat[0]:.2f} ms, median {statistics.median(lat):.3f} ms")
    arena.close()


if __name__ == "__main__":
    main()
