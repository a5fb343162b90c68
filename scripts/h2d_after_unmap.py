"""How fast a host-to-device copy runs into memory that a region released just before.

    python3 scripts/h2d_after_unmap.py      # on the device, after `source scripts/device-env.sh`

to_train puts the engine to sleep (its KV pool, most of the card, goes back to the driver)
and then copies the trainer's parameters in. This times that copy (CUDA events on a copy
stream, pinned source) into freshly allocated memory right after a large region's sleep, after
waits of 0.05-1 s, and into memory that stayed allocated, so the ledger can tell the link's
rate from whatever the driver does to pages it just got back.
"""

import time

import torch

from handoff.memory import RegionPool, aggressive_empty_cache

GiB = 1 << 30
DEVICE = torch.device("cuda")


def h2d_seconds(dst: torch.Tensor, src: torch.Tensor) -> float:
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for lo in range(0, dst.numel(), 64 << 20):   # the arena's chunk size
            dst[lo:lo + (64 << 20)].copy_(src[lo:lo + (64 << 20)], non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main(region_gib: int = 100, copy_gib: float = 7.5) -> None:
    nbytes = int(copy_gib * GiB)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pool = RegionPool(DEVICE)
    with pool.region("kv_cache"):
        kv = torch.empty(region_gib * GiB, dtype=torch.uint8, device=DEVICE)
    pool.track("kv_cache", [kv])
    warm = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    print(f"H2D of {copy_gib} GiB (pinned, 64 MiB chunks); region {region_gib} GiB")
    print("case                                   seconds    GB/s")
    for wait_s in (0.0, 0.0, 0.05, 0.2, 1.0, None):
        kv.fill_(1)
        torch.cuda.synchronize()
        if wait_s is None:
            name, dst = "into memory allocated all along", warm
        else:
            pool.sleep(["kv_cache"], level=2)
            time.sleep(wait_s)
            name, dst = f"fresh alloc {wait_s:.2f} s after the sleep", torch.empty_like(warm)
        seconds = h2d_seconds(dst, src)
        print(f"{name:<38}{seconds:8.3f}{nbytes / seconds / 1e9:8.1f}")
        if wait_s is not None:
            del dst
            aggressive_empty_cache()
            pool.wake_up(["kv_cache"])
    pool.sleep(["kv_cache"], level=2)


if __name__ == "__main__":
    main()
