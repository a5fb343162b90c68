"""Where a step's switch back to rollout spends its time, host and device side by side.

    python3 scripts/profile_switch.py examples/h200-4b.yaml run.steps=4 run.checkpoint=false \
        --steps 3 4 --out /tmp/switch-trace   # on the device, after `source scripts/device-env.sh`

Runs `handoff train` with the given config and profiles `HybridWorker.to_rollout` of the given
steps (torch.profiler, CPU + CUDA; two consecutive steps show what changes from one to the
next). The pieces of the switch are labelled (record_function), so each step's table says when
each started on the host and how long it ran, and when the D2H copies and the compute stream's
kernels ran on the device, all in ms from the switch's start. The Chrome trace of each step
(open it in https://ui.perfetto.dev) lands in --out.
"""

import argparse
import functools
import gc
import json
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from handoff import worker as worker_module
from handoff.config import load_config
from handoff.loop import Run
from handoff.memory.regions import RegionPool
from handoff.memory.staging import PinnedArena
from handoff.memory.tms_backend import TmsBackend
from handoff.rollout.engine import Engine
from handoff.train.model import ShardedModel

# (owner, attribute, label): the calls a switch is made of.
PIECES = [
    (ShardedModel, "to", "actor.to"),
    (PinnedArena, "stage", "arena.stage"),
    (PinnedArena, "offload", "arena.offload"),
    (Engine, "wake_up", "engine.wake_up"),
    (RegionPool, "wake_up", "pool.wake_up"),
    (TmsBackend, "remap", "tms.remap"),
    (Engine, "load_weights", "engine.load_weights"),
    (worker_module, "sync_weights", "sync_weights"),
    (worker_module, "aggressive_empty_cache", "aggressive_empty_cache"),
    (worker_module.HybridWorker, "probe", "probe"),
    (gc, "collect", "gc.collect"),
]


def label(fn, name: str):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with record_function(f"switch:{name}"):
            return fn(*args, **kwargs)
    return wrapped


def profiled_to_rollout(steps: list[int], out: Path, holder: dict):
    plain = worker_module.HybridWorker.to_rollout

    def to_rollout(self):
        step = self.step + 1   # metrics count steps from 1
        if step not in steps:
            return plain(self)
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            with record_function("switch:to_rollout"):
                result = plain(self)
            if cuda:
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(out / f"to_rollout.step{step}.json"))
        holder[step] = prof.events()
        return result
    return to_rollout


def table(events) -> list[dict]:
    """One row per labelled host call, per CUDA runtime call of 0.1 ms or more (an
    allocation, a blocking copy, a wait) and per device activity kind, in ms from the start."""
    spans = [e for e in events if e.name.startswith("switch:")]
    t0 = min(e.time_range.start for e in spans)
    slow_calls = [e for e in events if e.device_type == DeviceType.CPU
                  and e.name.startswith("cu") and e.time_range.elapsed_us() >= 100]
    rows = [{"what": (e.name[len("switch:"):] if e in spans else e.name),
             "where": "host" if e in spans else "runtime",
             "start_ms": (e.time_range.start - t0) / 1e3,
             "ms": (e.time_range.end - e.time_range.start) / 1e3} for e in spans + slow_calls]
    device = {}
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        kind = ("memcpy " + e.name.split()[1] if "Memcpy" in e.name
                else "memset" if "Memset" in e.name else "kernels")
        lo, hi, busy = device.get(kind, (float("inf"), 0.0, 0.0))
        device[kind] = (min(lo, e.time_range.start), max(hi, e.time_range.end),
                        busy + e.time_range.elapsed_us())
    for kind, (lo, hi, busy) in device.items():
        rows.append({"what": kind, "where": "device", "start_ms": (lo - t0) / 1e3,
                     "ms": (hi - lo) / 1e3, "busy_ms": busy / 1e3})
    return sorted(rows, key=lambda r: r["start_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, nargs="+", default=[2],
                    help="the steps (as metrics.jsonl counts) whose switch is profiled")
    ap.add_argument("--out", type=Path, default=Path("switch-trace"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for owner, attr, name in PIECES:
        setattr(owner, attr, label(getattr(owner, attr), name))
    holder: dict = {}
    worker_module.HybridWorker.to_rollout = profiled_to_rollout(args.steps, args.out, holder)
    Run(load_config(args.config, args.overrides)).run()
    for step, events in sorted(holder.items()):
        rows = table(events)
        (args.out / f"to_rollout.step{step}.table.json").write_text(json.dumps(rows, indent=1))
        print(f"step {step}\n{'what':<32}{'where':<8}{'start ms':>10}{'ms':>10}{'busy ms':>10}")
        for r in rows:
            busy = f"{r['busy_ms']:10.1f}" if "busy_ms" in r else ""
            print(f"{r['what']:<32}{r['where']:<8}{r['start_ms']:10.1f}{r['ms']:10.1f}{busy}")


if __name__ == "__main__":
    main()
