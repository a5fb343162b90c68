"""What mapping and unmapping a memory region costs on this GPU, by size and allocation count.

    python3 scripts/remap_sweep.py          # on the device, after `source scripts/device-env.sh`

For each (GiB, allocations): the median of 3 level-2 sleeps and wakes right after each other,
then one wake after torch's allocator used and returned the same amount, then one more sleep.
The regions stay asleep (torch_memory_saver keeps their addresses until the process ends).
Results and what they mean for the ledger: docs/PERF.md, "Memory runtime".
"""

import statistics
import time

import torch

from handoff.memory.regions import RegionPool

from handoff.memory.allocator import aggressive_empty_cache

GiB = 1 << 30
DEVICE = torch.device("cuda")


def timed_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def sweep(gib: int, allocations: int) -> tuple:
    pool = RegionPool(DEVICE)
    with pool.region("kv_cache"):
        blocks = [torch.empty(gib * GiB // allocations, dtype=torch.uint8, device=DEVICE)
                  for _ in range(allocations)]
    for b in blocks:
        b.fill_(1)
    sleeps, wakes = [], []
    for _ in range(3):
        sleeps.append(timed_ms(lambda: pool.sleep(["kv_cache"], level=2)))
        wakes.append(timed_ms(lambda: pool.wake_up(["kv_cache"])))
    pool.sleep(["kv_cache"], level=2)
    used = torch.empty(gib * GiB, dtype=torch.uint8, device=DEVICE)
    used.fill_(2)
    del used
    aggressive_empty_cache()
    wake_after_torch = timed_ms(lambda: pool.wake_up(["kv_cache"]))
    sleep_again = timed_ms(lambda: pool.sleep(["kv_cache"], level=2))
    return (gib, allocations, statistics.median(sleeps), statistics.median(wakes),
            wake_after_torch, sleep_again)


if __name__ == "__main__":
    rows = [sweep(gib, n) for gib, n in [(8, 1), (8, 400), (32, 1), (100, 1)]]
    print("GiB allocations sleep_ms wake_ms wake_after_torch_ms sleep_again_ms")
    for row in rows:
        print("%3d %11d %8.1f %7.1f %19.1f %14.1f" % row)
