"""Where a host-bound switch action's time goes, step by step: `handoff train` with every
ledger action (HybridWorker._timed) watched.

The 14B LoRA run's sync, sleep and wake (10-40 ms of driver calls and launches each) took
one of two times a step, 1.7-2x apart. Per action this prints the wall time, the host's part
(until the action's calls return), the thread's CPU time and involuntary context switches,
the garbage collector's pauses, the hypervisor's steal ticks, the CPUs the thread ran on,
and a fixed pure-Python loop timed right before (the host's speed at that moment): which
of them moves with the slow mode says whose time it is.

    python3 scripts/device/host_probe.py [--pin CPUS] -- examples/h200-4b.yaml key=value ...
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import threading
import time

ROWS: list[dict] = []
WRITES: list[dict] = []   # adapter loads' writes
_action: dict = {"name": None}
_gc = {"t0": 0.0, "paused": 0.0, "collections": 0}


def _gc_callback(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["t0"] = time.perf_counter()
    else:
        _gc["paused"] += time.perf_counter() - _gc["t0"]
        _gc["collections"] += 1


def _steal_ticks() -> int:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def _cpu_now() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _spin_ms() -> float:
    t0 = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i
    return (time.perf_counter() - t0) * 1e3


def watch() -> None:
    # Imported here: torch starts its threads after --pin held the process.
    from handoff.switch import clock as clock_module
    from handoff.switch.worker import HybridWorker

    gc.callbacks.append(_gc_callback)
    original_timed = clock_module.StepClock.timed
    original_worker_timed = HybridWorker._timed

    def worker_timed(self, record, action, fn, nbytes=lambda: 0):
        _action["name"] = action
        try:
            return original_worker_timed(self, record, action, fn, nbytes)
        finally:
            _action["name"] = None

    def timed(self, fn):
        if _action["name"] is None:
            return original_timed(self, fn)
        spin = _spin_ms()
        clock_module.wait_for_compute(self.device)
        gc0, gcn0 = _gc["paused"], _gc["collections"]
        ru0, steal0, cpu0 = resource.getrusage(resource.RUSAGE_THREAD), _steal_ticks(), _cpu_now()
        cpu_t0, t0 = time.thread_time(), time.perf_counter()
        result = fn()
        host = time.perf_counter() - t0
        cpu = time.thread_time() - cpu_t0
        clock_module.wait_for_compute(self.device)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_THREAD)
        ROWS.append({"action": _action["name"], "wall_ms": wall * 1e3, "host_ms": host * 1e3,
                     "cpu_ms": cpu * 1e3, "gc_ms": (_gc["paused"] - gc0) * 1e3,
                     "gcs": _gc["collections"] - gcn0,
                     "invol_cs": ru1.ru_nivcsw - ru0.ru_nivcsw,
                     "vol_cs": ru1.ru_nvcsw - ru0.ru_nvcsw,
                     "steal": _steal_ticks() - steal0, "cpus": f"{cpu0}>{_cpu_now()}",
                     "spin_ms": spin, "threads": threading.active_count()})
        return result, wall

    clock_module.StepClock.timed = timed
    HybridWorker._timed = worker_timed

    # Each adapter load's writes (rollout/lora.py): launched, captured or replayed.
    import torch

    from handoff.rollout import lora
    original_write = lora._LoadPlan.write

    def write(self, *args):
        graph, t0 = self.graph, time.perf_counter()
        original_write(self, *args)
        host = time.perf_counter() - t0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        path = ("launched" if self.graph is None else "replayed" if self.graph is graph
                else "captured")
        WRITES.append({"path": path, "host_ms": host * 1e3,
                       "wall_ms": (time.perf_counter() - t0) * 1e3})

    lora._LoadPlan.write = write


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pin", default="", help="CPUs for the process, e.g. 4-7")
    parser.add_argument("--json", default="", help="write the rows here")
    parser.add_argument("train_args", nargs="+")
    args = parser.parse_args()
    if args.pin:
        lo, _, hi = args.pin.partition("-")
        os.sched_setaffinity(0, range(int(lo), int(hi or lo) + 1))
    watch()
    from handoff.cli import app
    try:
        app(["train", *args.train_args], standalone_mode=False)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"actions": ROWS, "adapter_writes": WRITES}, f)
        keys = ["wall_ms", "host_ms", "cpu_ms", "gc_ms", "gcs", "invol_cs", "vol_cs", "steal",
                "cpus", "spin_ms", "threads"]
        print(f"{'action':22}" + "".join(f"{k:>10}" for k in keys))
        for row in ROWS:
            print(f"{row['action']:22}" + "".join(
                f"{row[k]:>10.1f}" if isinstance(row[k], float) else f"{row[k]:>10}"
                for k in keys))
        print(f"{'adapter writes':22}{'host_ms':>10}{'wall_ms':>10}")
        for row in WRITES:
            print(f"{row['path']:22}{row['host_ms']:>10.2f}{row['wall_ms']:>10.2f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
