"""The KV pool's map (wake) rate against what happened since its pages were released.

A run's KV wake mapped at about twice the rate its start-up calibration measured (the ledger
priced it at 0.43-0.51x of what it took). The calibration maps a region `settle` seconds after
releasing that same region; in the run, the trainer allocates the released pages through
torch's caching allocator for the whole training phase and hands them back right before the
wake. This probe times the wake of one `--gib` region, through the elastic arena (what
rollout.kv_pool=elastic maps) and torch_memory_saver (the fixed pool), after:

* own:S       the region released S seconds before;
* train:H     the region released, then the same bytes allocated and written by torch, held H
              seconds, freed (empty_cache) right before the wake;
* train:H+W   as train:H, the wake W seconds after the free.

    python3 scripts/device/map_probe.py --gib 40        (on the GPU machine; a table last)

With --sleep it times the sleep (unmap) instead, the region written S seconds before
(`written:S`): a generation writes its pool right up to the sleep, the start-up calibration
2 s before. --slabs sets the arena's (2 x layers: 80 for the Qwen3-14B shape).
"""

from __future__ import annotations

import argparse
import time

import torch

from handoff.memory.allocator import aggressive_empty_cache
from handoff.memory.elastic import ElasticArena
from handoff.memory.regions import RegionPool


def _sync() -> None:
    torch.cuda.synchronize()


class Arena:
    name = "elastic"
    slabs = 72

    def __init__(self, nbytes: int):
        granule = ElasticArena.granule_bytes("cuda")
        slabs = self.slabs
        slab = -(-nbytes // slabs // granule) * granule
        self.arena = ElasticArena("cuda", slabs=slabs, slab_bytes=slab)
        self.bytes = slabs * slab
        self.wake()
        self.arena.view(torch.uint8, (self.bytes,)).fill_(1)

    def sleep(self) -> None:
        _sync()
        self.arena.release()

    def wake(self) -> None:
        self.arena.grow_to(self.arena.slab_bytes)
        _sync()

    def write(self) -> None:
        self.arena.view(torch.uint8, (self.bytes,)).fill_(3)


class Saver:
    name = "tms"

    def __init__(self, nbytes: int):
        self.pool = RegionPool(torch.device("cuda"))
        with self.pool.region("probe"):
            self.block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.block.fill_(1)
        self.pool.track("probe", self.block)
        self.bytes = self.pool.region_bytes("probe")

    def sleep(self) -> None:
        _sync()
        self.pool.sleep(["probe"], level=2)
        _sync()

    def wake(self) -> None:
        self.pool.wake_up(["probe"])
        _sync()

    def write(self) -> None:
        self.block.fill_(3)


def timed_sleep(region, *, settle: float = 0.0) -> float:
    """Map the region, write all of it, wait `settle` s, then time its sleep (unmap)."""
    region.wake()
    region.write()
    _sync()
    time.sleep(settle)
    t0 = time.perf_counter()
    region.sleep()
    _sync()
    return time.perf_counter() - t0


def timed_wake(region, *, settle: float = 0.0, hold: float | None = None,
               after_free: float = 0.0) -> float:
    region.sleep()
    if hold is None:
        time.sleep(settle)
    else:
        blob = torch.empty(region.bytes, dtype=torch.uint8, device="cuda").fill_(2)
        _sync()
        time.sleep(hold)
        del blob
        torch.cuda.empty_cache()
        time.sleep(after_free)
    t0 = time.perf_counter()
    region.wake()
    return time.perf_counter() - t0


def sweep(classes, nbytes: int, conditions: list[tuple[str, dict]], timed, repeats: int, *,
          warm_up: dict | None = None) -> list[tuple]:
    """For each region class: one region of `nbytes`, a warm-up wake, then `repeats` timed
    wakes (`timed(region, **kw)`) per (label, kw) condition, each line printed as it lands.
    Returns rows (pool, condition, seconds, TB/s)."""
    rows = []
    for cls in classes:
        region = cls(nbytes)
        timed(region, **(warm_up or {}))
        for label, kw in conditions:
            secs = [timed(region, **kw) for _ in range(repeats)]
            rate = [region.bytes / s / 1e12 for s in secs]
            rows.append((region.name, label, secs, rate))
            print(f"{region.name:8s} {label:11s} " + "  ".join(
                f"{s * 1e3:7.1f} ms {r:5.2f} TB/s" for s, r in zip(secs, rate)), flush=True)
        region.sleep()
        del region
        aggressive_empty_cache()
    return rows


def print_table(rows: list[tuple], setting: str) -> None:
    print(f"\n| pool | condition | ms | TB/s |  ({setting}, {torch.cuda.get_device_name()})"
          "\n|---|---|---|---|")
    for name, label, secs, rate in rows:
        print(f"| {name} | {label} | {' / '.join(f'{s * 1e3:.1f}' for s in secs)} | "
              f"{' / '.join(f'{r:.2f}' for r in rate)} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=40.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sleep", action="store_true", help="time the unmap, not the map")
    p.add_argument("--slabs", type=int, default=Arena.slabs)
    args = p.parse_args()
    nbytes = int(args.gib * (1 << 30))
    Arena.slabs = args.slabs
    if args.sleep:
        rows = sweep((Arena, Saver), nbytes, [("written:0", {}), ("written:2", {"settle": 2.0})],
                     timed_sleep, args.repeats)
        print_table(rows, f"{args.gib:g} GiB, the sleep (unmap), {args.slabs} slabs")
        return
    conditions = [("own:0", {}), ("own:2", {"settle": 2.0}), ("own:16", {"settle": 16.0}),
                  ("train:1", {"hold": 1.0}), ("train:12", {"hold": 12.0}),
                  ("train:12+2", {"hold": 12.0, "after_free": 2.0})]
    rows = sweep((Arena, Saver), nbytes, conditions, timed_wake, args.repeats,
                 warm_up={"settle": 1.0})
    print_table(rows, f"{args.gib:g} GiB")


if __name__ == "__main__":
    main()
