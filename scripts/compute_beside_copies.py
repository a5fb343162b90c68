"""Does work on the compute stream slow down while a large set's copies run on a copy stream?

    python3 scripts/compute_beside_copies.py           # on the device, after device-env.sh
    CUDA_DEVICE_MAX_CONNECTIONS=32 python3 scripts/compute_beside_copies.py

In the streamed switch the work beside the copies ran slower by about the copies' own time
(the update +0.84 s beside the optimizer's 0.875 s copy back: docs/PERF.md, "The streamed
switch"), with no wait for a copy counted. This times, on the compute stream, a fixed amount
of work (bf16 GEMMs; then micro-batch-like steps: a small pageable H2D, GEMMs, a `.item()`)
idle and with a 12 GB set queued through the arena on its copy stream, in both directions.
Run it with the environment variable above too: if the compute stream shares a hardware
queue with the copy stream (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), its launches wait
behind the queued copies.
"""

import os
import time

import torch

from handoff.memory.staging import PinnedArena

GB = 1 << 30


def work(a: torch.Tensor, steps: int, *, with_io: bool) -> float:
    """Wall seconds of `steps` units of compute-stream work."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        if with_io:
            torch.arange(4096).to(a.device)            # a micro-batch's inputs (pageable)
        for _ in range(4):
            a @ a
        if with_io:
            (a[0, 0] * 0).item()                       # a readback that syncs the host
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    dev = torch.device("cuda:0")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    arena = PinnedArena()
    data = torch.zeros(12 * GB // 4, dtype=torch.float32, device=dev)
    arena.stage("set", [data])
    arena.offload("set", free_device=False).wait()     # the host copy valid both ways
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "(unset)")
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={connections}")
    for with_io in (False, True):
        work(a, 20, with_io=with_io)                   # warm-up
        idle = work(a, 60, with_io=with_io)
        for direction in ("h2d", "d2h"):
            copy = (arena.onload("set") if direction == "h2d"
                    else arena.offload("set", free_device=False))
            beside = work(a, 60, with_io=with_io)
            copy.wait()
            print(f"{'steps with io' if with_io else 'GEMMs only':14s} beside {direction}: "
                  f"{beside:.3f} s, idle {idle:.3f} s (+{beside - idle:.3f} s; the copy "
                  f"{copy.seconds:.3f} s)")
    arena.close()


if __name__ == "__main__":
    main()
