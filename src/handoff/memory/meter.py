"""The memory meter: probes at named points -> a timeline (JSON lines) -> a picture (PNG).

    meter = MemoryMeter("cuda", pool=pool, arena=arena)
    meter.probe("before wake weights", step=3)
    ...
    meter.write_jsonl("runs/x/memory.jsonl")
    meter.plot("runs/x/memory.png")       # who held the card when

Each probe is a dict (all sizes in bytes):
  name, step-like extras, wall (seconds since the meter started), time (unix seconds),
  device, allocated (bytes in live tensors), reserved (bytes the caching allocator holds),
  driver_total, driver_free, driver_used, regions {tag: bytes}, awake {tag: bool},
  regions_awake (bytes of awake regions), outside_torch (of which mapped by an elastic
  region, not through torch's allocator), pinned_staged (host bytes the arenas reserve).

What the numbers mean per device:
* CUDA: allocated/reserved from torch.cuda.memory_allocated/reserved (they count region
  pools too, asleep or not, because the caching allocator does not see a region sleep);
  driver_* from cudaMemGetInfo (the whole card, all processes); regions from the pool.
* CPU: there is no caching allocator and no card, so allocated = reserved = this process's
  resident set (RSS); driver_total/driver_free = the OS's MemTotal/MemAvailable (the whole
  machine); regions = bytes of the pool's tracked tensors; pinned_staged = arena host bytes
  (plain memory on CPU, and part of the RSS).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import torch

from handoff.dist import with_index
from handoff.memory.allocator import host_memory, rss_bytes
from handoff.safe_files import replace_file
from handoff.units import GiB


class MemoryMeter:
    """Record memory probes for one device; optionally read a RegionPool and PinnedArenas."""

    def __init__(self, device: torch.device | str, pool=None, arena=None) -> None:
        self.device = with_index(device)
        self.pool = pool
        self.arena = arena
        self.timeline: list[dict] = []
        self._t0 = time.perf_counter()

    @property
    def last(self) -> dict | None:
        """The most recent probe, or None before the first."""
        return self.timeline[-1] if self.timeline else None

    def _arenas(self) -> list:
        arenas = [self.arena, getattr(self.pool, "arena", None)]
        out = []
        for a in arenas:
            if a is not None and all(a is not b for b in out):
                out.append(a)
        return out

    def probe(self, name: str, **extra) -> dict:
        """Read every counter now, append the record to the timeline and return it."""
        if self.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            allocated = reserved = rss_bytes()
            total, free = host_memory()
        regions, awake, outside = {}, {}, 0
        if self.pool is not None:
            for tag in self.pool.tags:
                regions[tag] = self.pool.region_bytes(tag)
                awake[tag] = self.pool.is_awake(tag)
                outside += regions[tag] if self.pool.is_elastic(tag) else 0
        record = {
            "name": name,
            **extra,
            "wall": time.perf_counter() - self._t0,
            "time": time.time(),
            "device": str(self.device),
            "allocated": allocated,
            "reserved": reserved,
            "driver_total": total,
            "driver_free": free,
            "driver_used": total - free,
            "regions": regions,
            "awake": awake,
            "regions_awake": sum(b for t, b in regions.items() if awake[t]),
            "outside_torch": outside,
            "pinned_staged": sum(a.bytes_staged() for a in self._arenas()),
        }
        self.timeline.append(record)
        return record

    def timeline_jsonl(self) -> bytes:
        """The whole timeline, one JSON object per probe."""
        return "".join(json.dumps(record) + "\n" for record in self.timeline).encode()

    def write_jsonl(self, path: str | Path) -> Path:
        """Write the whole timeline (timeline_jsonl); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, self.timeline_jsonl(), path.parent)   # whole or not at all; no link followed
        return path

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Render memory by owner over the probes as a PNG (see plot_timeline)."""
        return plot_timeline(self.timeline, path, title=title)

    def report_files(self, step: int) -> dict[str, bytes]:
        """What a run's report writes of the meter: memory_timeline.jsonl (every probe) and
        memory_timeline.png (the probes of `step`, 0-based: step_probes)."""
        return {"memory_timeline.jsonl": self.timeline_jsonl(),
                "memory_timeline.png": timeline_png(step_probes(self.timeline, step),
                                                    title=f"memory by owner, step {step + 1}")}


def step_probes(timeline: list[dict], step: int) -> list[dict]:
    """The probes of `step` (0-based), after the card as the step found it: the last probe
    before it (the previous switch's KV wake, which an elastic pool grows from), named with
    its step counted from 1. The whole timeline if the step has none."""
    probes = [p for p in timeline if p.get("step") == step]
    if not probes:
        return timeline
    before = [p for p in timeline if p.get("step", 0) < step]
    return ([dict(before[-1], name=f"{before[-1]['name']} (step {step})")] if before else []
            ) + probes


def owners(record: dict) -> dict[str, int]:
    """Split one probe's device memory by owner (bytes); the parts sum to what is shown.

    CUDA: each awake region; "torch (not in regions)" = reserved minus the bytes of every
    region torch allocated (live tensors + the caching allocator's cache outside regions; an
    elastic region is mapped outside torch); "other (context, NCCL,
    other processes)" = driver_used minus the two; "free" = driver_free.
    CPU: each awake region; "process (rest of RSS)" = RSS minus awake regions; no free part
    (the machine's free RAM would dwarf the picture).
    """
    parts = {f"region {t}": b for t, b in record["regions"].items() if record["awake"][t]}
    awake_bytes = sum(parts.values())
    if record["device"].startswith("cuda"):
        in_torch = sum(record["regions"].values()) - record.get("outside_torch", 0)
        torch_rest = max(record["reserved"] - in_torch, 0)
        parts["torch (not in regions)"] = torch_rest
        parts["other (context, NCCL, other processes)"] = max(
            record["driver_used"] - torch_rest - awake_bytes, 0)
        parts["free"] = record["driver_free"]
    else:
        parts["process (rest of RSS)"] = max(record["reserved"] - awake_bytes, 0)
    return parts


def plot_timeline(timeline: list[dict], path: str | Path, *, title: str | None = None) -> Path:
    """Write timeline_png to `path`; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, timeline_png(timeline, title=title), path.parent)
    return path


def timeline_png(timeline: list[dict], *, title: str | None = None) -> bytes:
    """Stacked bars of memory by owner per probe (top) and pinned host bytes (bottom)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    split = [owners(r) for r in timeline]
    keys = list(dict.fromkeys(k for parts in split for k in parts))
    palette = ["#DD8452", "#55A868", "#C44E52", "#8172B3", "#CCB974", "#64B5CD", "#DA8BC3"]
    fixed = {"torch (not in regions)": "#4C72B0", "process (rest of RSS)": "#4C72B0",
             "other (context, NCCL, other processes)": "#555555", "free": "#E8E8E8"}
    colors, i = {}, 0
    for k in keys:
        colors[k] = fixed.get(k) or palette[i % len(palette)]
        i += k not in fixed
    n = len(timeline)
    fig = Figure(figsize=(max(8.0, 0.9 * n + 3), 7.5), dpi=110)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 1, height_ratios=[4, 1], hspace=0.08)
    ax, ax_pin = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    xs = list(range(n))
    bottom = [0.0] * n
    for k in keys:
        heights = [parts.get(k, 0) / GiB for parts in split]
        ax.bar(xs, heights, bottom=bottom, color=colors[k], label=k, width=0.75,
               edgecolor="white", linewidth=0.5, hatch="//" if k == "free" else None)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, parts in zip(xs, split):
        used = sum(v for k, v in parts.items() if k != "free") / GiB
        ax.annotate(f"{used:.1f}", (x, used), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    device = timeline[0]["device"] if timeline else "?"
    unit = "device memory" if device.startswith("cuda") else "process memory (CPU: RSS)"
    ax.set_ylabel(f"{unit}, GiB")
    ax.set_title(title or f"who holds {device}, probe by probe")
    ax.set_xticks(xs)
    ax.set_xticklabels([])
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=9, frameon=False, title="owner (numbers: GiB in use)",
              title_fontsize=9)
    ax_pin.bar(xs, [r["pinned_staged"] / GiB for r in timeline], color="#8C8C8C", width=0.75)
    ax_pin.set_ylabel("host staged,\nGiB")
    ax_pin.set_xticks(xs)
    ax_pin.set_xticklabels([r["name"] for r in timeline], rotation=35, ha="right", fontsize=9)
    ax_pin.set_xlim(ax.get_xlim())
    ax_pin.grid(axis="y", alpha=0.3)
    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight")
    return png.getvalue()
