"""Why the start-up calibration priced a shared-base LoRA run's KV wake at 9x what it took.

On an H100 (2026-12-07, Qwen3-14B shape, LoRA, elastic pool) the calibration, which replays the
trainer's activations (one torch tensor, handed back right before the measured wake), mapped a
36.67 GiB region at 409 GB/s; the run's own wakes mapped 46 GiB at 3.7 TB/s. This times the
wake of one `--gib` region, beside `--held-gib` held (the base), through torch_memory_saver
(what calibrate maps) and the elastic arena (what rollout.kv_pool=elastic maps), after:

* rested        the region released 2 s before (the calibration before the replay);
* replay:A      then A GiB allocated and written by torch in one tensor, freed by empty_cache
                right before the wake (the calibration now);
* chunks:A      the same in 512 MiB tensors (a trainer's activations are many tensors);
* trained:A     chunks held 3 s (a training phase), then freed right before.

    python3 scripts/device/calib_probe.py --gib 36 --held-gib 29.5 --replay-gib 12,30
"""

from __future__ import annotations

import argparse
import time

import torch
from map_probe import Arena, Saver, _sync, print_table, sweep   # map_probe.py, beside this

from handoff.memory.allocator import aggressive_empty_cache

GIB = 1 << 30
CHUNK = 512 << 20


def timed_wake(region, *, replay: int = 0, chunked: bool = False, hold: float = 0.0) -> float:
    region.sleep()
    time.sleep(2.0)
    if replay:
        sizes = [CHUNK] * (replay // CHUNK) + ([replay % CHUNK] if replay % CHUNK else []) \
            if chunked else [replay]
        blobs = [torch.ones(n, dtype=torch.uint8, device="cuda") for n in sizes]
        _sync()
        time.sleep(hold)
        del blobs
        aggressive_empty_cache()
    t0 = time.perf_counter()
    region.wake()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=36.0)
    p.add_argument("--held-gib", type=float, default=29.5)
    p.add_argument("--replay-gib", default="12,30")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    held = torch.empty(int(args.held_gib * GIB), dtype=torch.uint8, device="cuda").fill_(3)
    conditions = [("rested", {})]
    for a in (float(x) for x in args.replay_gib.split(",")):
        n = int(a * GIB)
        conditions += [(f"replay:{a:g}", {"replay": n}),
                       (f"chunks:{a:g}", {"replay": n, "chunked": True}),
                       (f"trained:{a:g}", {"replay": n, "chunked": True, "hold": 3.0})]
    rows = sweep((Saver, Arena), int(args.gib * GIB), conditions, timed_wake, args.repeats)
    del held
    print_table(rows, f"{args.gib:g} GiB region, {args.held_gib:g} GiB held")


if __name__ == "__main__":
    main()
