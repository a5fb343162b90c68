"""`handoff bench sweep`: the real cost of colocation, measured as the source says to.

    handoff bench sweep examples/h200-reasoning.yaml --out sweep/            # 0.50, 0.55, ...
    handoff bench sweep CONFIG --utils 0.8,0.85 --out sweep/                 # more points
    handoff bench sweep CONFIG --offloads none,params+ref,all --out sweep/   # offload sets

Each point is the real colocated loop (`handoff train`: engine + trainer + switch) for a few
steps at one gpu_memory_utilization, in its own process, so an out-of-memory is a result
(the boundary) and not the end of the sweep. The first point measures the run's rates;
the others read them from its summary.json (`run.rates_file`), so a point costs its model
loads and its steps. The utilizations of an offload set rise until the first point that
cannot run, which is reported with the owner that did not fit. One more point runs the
engine alone on the card (bench/exclusive.py): the source's "exclusive card" row, the
reference the tax is measured against.

The model is checked once before any point runs (a missing or broken model.path is one
line, not a failed point after another). Every point is kept in `sweep.json` under its
label (`all@0.50`); running again with other `--utils` adds points, with the same ones
replaces them. `sweep.md` and `sweep.png` (bench/sweep_report.py) are written from the
whole file each time. Beside each measured point stands the planner's prediction for it:
the KV pool, concurrency, decode step and generation time of `plan.kvpool` fed with the
run's measured rates and workload.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from handoff.bench.sweep_report import write_report
from handoff.config import Config, load_config
from handoff.demo_model import SMOLLM2_PRESET
from handoff.errors import HandoffError
from handoff.lengths import ResponseLengths
from handoff.model_files import check_model_dir
from handoff.model_source import resolve_model
from handoff.plan.hardware import HardwareProfile, hardware_profile
from handoff.plan.kvpool import Workload, kv_row
from handoff.plan.ledger import Dtypes
from handoff.plan.shapes import PRESETS, load_shape
from handoff.plan.verdict import max_safe_utilization
from handoff.safe_files import link_refused, replace_file

# name -> (param_offload, optimizer_offload, ref_offload)
OFFLOAD_SETS = {"none": (False, False, False), "ref": (False, False, True),
                "params+ref": (True, False, True), "all": (True, True, True)}
DEFAULT_UTILS = tuple(round(0.5 + 0.05 * i, 2) for i in range(11))   # 0.50 .. 1.00
PROBES = ("before resume weights", "after update_weights", "after resume kv_cache")
# What an out-of-memory looks like in a point's output, and who did not fit.
_OOM = [(re.compile(r"cannot wake \['weights'\]"), "engine weights (wake)"),
        (re.compile(r"cannot wake \['kv_cache'\]"), "engine KV pool (wake)"),
        (re.compile(r"KV pool (would be|of .* does not fit)|cannot hold one sequence"),
         "engine KV pool (sizing at start)"),
        (re.compile(r"pinning .* host memory failed"), "pinned host memory"),
        (re.compile(r"OutOfMemoryError|CUDA out of memory"), None)]


@dataclass(frozen=True)
class Point:
    offloads: str
    util: float

    @property
    def label(self) -> str:
        return f"{self.offloads}@{self.util:.2f}"

    def overrides(self) -> list[str]:
        params, optimizer, ref = OFFLOAD_SETS[self.offloads]
        return [f"rollout.gpu_memory_utilization={self.util}", f"memory.param_offload={params}",
                f"memory.optimizer_offload={optimizer}", f"memory.ref_offload={ref}"]


def offload_set_of(cfg: Config) -> str:
    flags = (cfg.memory.param_offload, cfg.memory.optimizer_offload, cfg.memory.ref_offload)
    for name, value in OFFLOAD_SETS.items():
        if value == flags:
            return name
    raise HandoffError(f"the config's offloads {flags} are none of the sweep's sets "
                       f"({', '.join(OFFLOAD_SETS)}): pass --offloads")


def _medians(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in (rows[1:] or rows) if key in r]
    return statistics.median(values) if values else None


def measured_point(out: Path) -> dict:
    """A finished point's numbers: medians over its steps after the first."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    steps = rows[1:] or rows
    decode_steps = sum(r["engine/decode_steps"] for r in steps)
    decode_s = sum(r["engine/decode_s"] for r in steps)
    probes = {}
    timeline = [json.loads(line) for line in
                (out / "memory_timeline.jsonl").read_text().splitlines() if line.strip()]
    last = [p for p in timeline if p.get("step") == rows[-1]["step"] - 1]
    for name in PROBES:
        probe = next((p for p in last if p["name"] == name), None)
        if probe is not None:
            probes[name] = probe["driver_used"]
    return {
        "status": "ok", "steps": len(rows),
        "kv_pool_bytes": rows[-1]["engine/kv_bytes"], "kv_blocks": rows[-1]["engine/kv_blocks"],
        "generation_seconds": _medians(rows, "timing_s/gen"),
        "tokens_per_second": _medians(rows, "tokens_per_s"),
        "peak_running": max(r["engine/peak_running"] for r in steps),
        "preemptions": _medians(rows, "engine/preemptions"),
        "decode_step_seconds": decode_s / decode_steps if decode_steps else None,
        "step_seconds": _medians(rows, "timing_s/step"),
        "train_seconds": _medians(rows, "timing_s/train"),
        "switch_seconds": summary["switch_seconds"],
        "prompt_length": _medians(rows, "prompt_length"),
        "response_length": _medians(rows, "response_length"),
        "probes_driver_used": probes, "rates": summary["rates"],
    }


def failed_point(log: str, out: Path) -> dict:
    """Why a point did not run: out of memory (the boundary, with the owner that did not fit
    and who held the card at the last probe) or another error, in the point's own words."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    message = (errors or lines or ["(no output)"])[-1]
    owner = None
    for pattern, who in _OOM:
        if pattern.search(log):
            owner = who or "trainer (a torch allocation)"
            break
    last_probe = None
    timeline = out / "memory_timeline.jsonl"
    if timeline.is_file():
        probes = [json.loads(line) for line in timeline.read_text().splitlines() if line.strip()]
        if probes:
            p = probes[-1]
            last_probe = {"name": p["name"], "step": p.get("step"), "driver_used": p["driver_used"],
                          "regions_awake": p["regions_awake"], "allocated": p["allocated"]}
            if owner == "trainer (a torch allocation)":
                owner = f"trainer (a torch allocation after probe {p['name']!r})"
    return {"status": "out_of_memory" if owner else "error", "owner": owner,
            "message": message, "last_probe": last_probe}


def planned_point(cfg: Config, rates: dict, util: float, *, prompt_len: float,
                  hw: HardwareProfile | None = None) -> dict:
    """The planner's KV pool, concurrency, decode step and generation time at `util` for this
    workload, its rates replaced by the ones the run measured (`hw`: this profile instead)."""
    from handoff.calibrate import Rates

    shape = load_shape(cfg.model.path)
    hw = hw or Rates(rates).profile(hardware_profile(cfg.hardware.name, cfg.hardware))
    dtypes = Dtypes.for_model(cfg.model.dtype, cfg.rollout.kv_dtype)
    ro = cfg.rollout
    lengths = ResponseLengths.parse(ro.response_lengths) if ro.response_lengths else None
    mean = min(lengths.mean, ro.max_tokens) if lengths else ro.max_tokens
    longest = min(lengths.max, ro.max_tokens) if lengths else ro.max_tokens
    responses = cfg.data.prompts_per_step * ro.n
    per_card = max(responses // cfg.parallel.gpus, 1)
    workload = Workload(prompt_len=max(int(round(prompt_len)), 1), response_len=max(int(mean), 1),
                        tokens_per_card=responses * mean / cfg.parallel.gpus,
                        max_response_len=longest, max_num_seqs=ro.max_num_seqs,
                        lengths=lengths.quantiles(per_card, ro.max_tokens) if lengths else None,
                        group_size=ro.n)
    row = kv_row(util, shape, hw, tp=cfg.parallel.tp, workload=workload,
                 weight_bytes=dtypes.engine_bytes, kv_bytes=dtypes.kv_bytes)
    return {"kv_pool_bytes": row.kv_pool_bytes, "concurrency": row.concurrency,
            "decode_step_seconds": row.decode_step_seconds,
            "tokens_per_second": row.tokens_per_second,
            "generation_seconds": row.generation_seconds, "tail_seconds": row.tail_seconds}


def safe_util(cfg: Config, offloads: str) -> float:
    """The planner's highest safe utilization for the config with offload set `offloads`."""
    shape = load_shape(cfg.model.path)
    hw = hardware_profile(cfg.hardware.name, cfg.hardware)
    params, optimizer, ref = OFFLOAD_SETS[offloads]
    memory = type(cfg.memory)(**{**vars(cfg.memory), "param_offload": params,
                                 "optimizer_offload": optimizer, "ref_offload": ref})
    dtypes = Dtypes.for_model(cfg.model.dtype, cfg.rollout.kv_dtype)
    return max_safe_utilization(shape, cfg.parallel, memory, hw, dtypes=dtypes,
                                ref=cfg.actor.kl_coef > 0)


def check_sweep_args(*, utils: list[float] | None, offloads: list[str] | None,
                     steps: int) -> None:
    """One line for arguments a sweep cannot run with, before anything is started (its --out:
    check_sweep_out)."""
    for name in offloads or []:
        if name not in OFFLOAD_SETS:
            raise HandoffError(f"--offloads {name!r} is not an offload set: use "
                               f"{', '.join(OFFLOAD_SETS)}")
    for u in utils or []:
        if not 0 < u <= 1:
            raise HandoffError(f"--utils {u} is outside (0, 1]: a share of the card")
    if steps < 2:
        raise HandoffError(f"--steps {steps}: a point needs 2 or more (the first is a warm-up)")


def check_sweep_model(cfg: Config) -> None:
    """The model every point loads, checked once before any runs: a missing or broken one
    would fail each point in its own process, and the sweep would carry on to the next."""
    path = resolve_model(cfg.model.path, materialise_presets=False)   # a Hub id: its snapshot
    if path in PRESETS or path == SMOLLM2_PRESET:   # each point writes its random init once
        return
    check_model_dir(path, flag="model.path")   # config, architecture, tokenizer, weights


def check_sweep_out(out: Path) -> None:
    """--out a directory (made if missing) with no link where the sweep writes: its files and
    its points' run directories (which it replaces) stay inside it."""
    for where in (out, *out.parents):
        if where.exists() and not where.is_dir():
            raise HandoffError(f"--out {str(out)!r}: {where} is a file, not a directory: pass "
                               "a directory (created if missing)")
    points = out / "points"
    names = [out / n for n in ("sweep.json", "sweep.md", "sweep.png", "points")]
    names += list(points.iterdir()) if points.is_dir() and not points.is_symlink() else []
    for path in names:
        if path.is_symlink():
            raise link_refused(path)


class Sweep:
    """The sweep's files and its points (see the module docstring)."""

    def __init__(self, config: str, overrides: list[str], out_dir: str | Path, *, steps: int,
                 timeout_s: float, progress=None):
        self.config, self.overrides = config, list(overrides)
        self.cfg = load_config(config, self.overrides)
        check_sweep_model(self.cfg)
        self.out = Path(out_dir)
        check_sweep_out(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.steps, self.timeout_s = steps, timeout_s
        self.progress = progress
        path = self.out / "sweep.json"
        self.state = json.loads(path.read_text()) if path.is_file() else {}
        self.state.update(config=config, overrides=self.overrides, model=self.cfg.model.path,
                          steps=steps)
        self.state.setdefault("points", {})

    def _rates_file(self) -> Path | None:
        for label, p in self.state["points"].items():
            summary = self.out / "points" / label / "summary.json"
            if p.get("measured", {}).get("status") == "ok" and summary.is_file():
                return summary
        return None

    def _run(self, command: list[str], log_path: Path, what: str) -> tuple[int, str]:
        """Run one point's process, its output to `log_path`; the progress line follows its
        step lines."""
        started = time.perf_counter()
        with log_path.open("w") as log:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1)
            try:
                for line in proc.stdout:
                    log.write(line)
                    if self.progress is not None and line.lstrip().startswith("step"):
                        self.progress(f"{what}: {' '.join(line.split()[:6])}")
                    if time.perf_counter() - started > self.timeout_s:
                        proc.kill()
                        log.write(f"\nerror: the point ran past --timeout {self.timeout_s:g} s\n")
                        break
            finally:
                proc.wait()
        return proc.returncode, log_path.read_text()

    def run_point(self, point: Point) -> dict:
        out = self.out / "points" / point.label
        shutil.rmtree(out, ignore_errors=True)   # the sweep owns its points' directories
        out.mkdir(parents=True)
        rates_path = self._rates_file()
        command = [sys.executable, "-m", "handoff", "train", self.config, *self.overrides,
                   *point.overrides(), f"run.out_dir={out}", f"run.steps={self.steps}",
                   "run.checkpoint=false"] + ([f"run.rates_file={rates_path}"] if rates_path
                                              else [])
        if self.progress is not None:
            self.progress(f"{point.label}: starting")
        code, log = self._run(command, out / "log.txt", point.label)
        measured = measured_point(out) if code == 0 else failed_point(log, out)
        entry = {"offloads": point.offloads, "util": point.util, "overrides": self.overrides,
                 "measured": measured}
        rates = measured.get("rates") or (json.loads(rates_path.read_text())["rates"]
                                          if rates_path else None)
        prompt_len = measured.get("prompt_length") or self._known_prompt_len()
        if rates is not None and prompt_len:
            entry["planned"] = planned_point(self._point_cfg(point), rates, point.util,
                                             prompt_len=prompt_len)
        self.state["points"][point.label] = entry
        self.save()
        return entry

    def _point_cfg(self, point: Point) -> Config:
        return load_config(self.config, self.overrides + point.overrides())

    def _known_prompt_len(self) -> float | None:
        for p in self.state["points"].values():
            length = p.get("measured", {}).get("prompt_length")
            if length:
                return length
        return None

    def run_exclusive(self) -> dict:
        """The engine alone on the card, the same prompts and lengths."""
        out = self.out / "points" / "exclusive"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        command = [sys.executable, "-m", "handoff.bench.exclusive", self.config,
                   "--steps", str(self.steps), "--out", str(out / "result.json"),
                   *self.overrides]
        if self.progress is not None:
            self.progress("exclusive card: starting")
        code, log = self._run(command, out / "log.txt", "exclusive card")
        measured = (json.loads((out / "result.json").read_text()) if code == 0
                    else failed_point(log, out))
        entry = {"offloads": "engine alone", "util": measured.get("util"), "measured": measured}
        rates = self._rates_file()
        if code == 0 and rates is not None:
            entry["planned"] = planned_point(self.cfg, json.loads(rates.read_text())["rates"],
                                             measured["util"],
                                             prompt_len=measured["prompt_length"])
        self.state["exclusive"] = entry
        self.save()
        return entry

    def save(self) -> None:
        self.state["boundary"] = boundaries(self.state["points"])
        replace_file(self.out / "sweep.json", json.dumps(self.state, indent=1).encode(), self.out)
        write_report(self.state, self.out)


def replan(config: str, overrides: list[str], out_dir: str | Path) -> dict:
    """Plan every point of `out_dir`/sweep.json again, from the rates each measured, with
    today's planner; rewrite its files. Runs nothing: for after the planner changed."""
    sweep = Sweep(config, overrides, out_dir, steps=1, timeout_s=0)
    entries = list(sweep.state["points"].items())
    if sweep.state.get("exclusive"):
        entries.append(("exclusive", sweep.state["exclusive"]))
    if not entries:
        raise HandoffError(f"{out_dir}/sweep.json holds no points to plan again: run the sweep")
    rates = next((p["measured"]["rates"] for _, p in entries if p["measured"].get("rates")), None)
    for label, entry in entries:
        m = entry["measured"]
        prompt_len = m.get("prompt_length") or sweep._known_prompt_len()
        if rates is None or not prompt_len or (label == "exclusive" and m.get("status") != "ok"):
            continue
        if label == "exclusive":
            point_cfg, util = sweep.cfg, m["util"]
        else:
            point = Point(entry["offloads"], entry["util"])
            point_cfg = load_config(config, [*entry.get("overrides", []), *overrides,
                                             *point.overrides()])
            util = entry["util"]
        entry["planned"] = planned_point(point_cfg, m.get("rates") or rates, util,
                                         prompt_len=prompt_len)
    sweep.state["steps"] = max(p["measured"].get("steps", 0) for _, p in entries)
    sweep.save()
    return sweep.state


def boundaries(points: dict) -> dict:
    """Per offload set: the lowest utilization that could not run, and why."""
    out = {}
    for label, p in sorted(points.items(), key=lambda kv: kv[1]["util"]):
        m = p["measured"]
        if m["status"] == "out_of_memory" and p["offloads"] not in out:
            out[p["offloads"]] = {"util": p["util"], "owner": m["owner"], "message": m["message"]}
    return out


def run_sweep(config: str, overrides: list[str], *, out_dir: str, utils: list[float] | None,
              offloads: list[str] | None, steps: int = 3, exclusive: bool = True,
              timeout_s: float = 600.0, progress=None) -> dict:
    """Every point the arguments name (see the module docstring); returns sweep.json's dict."""
    check_sweep_args(utils=utils, offloads=offloads, steps=steps)
    sweep = Sweep(config, overrides, out_dir, steps=steps, timeout_s=timeout_s,
                  progress=progress)
    sets = offloads or [offload_set_of(sweep.cfg)]
    for name in sets:
        chosen = utils or (DEFAULT_UTILS if not offloads
                           else [max(round(safe_util(sweep.cfg, name), 2), 0.05)])
        for util in sorted(chosen):
            entry = sweep.run_point(Point(name, util))
            if entry["measured"]["status"] == "out_of_memory":
                break   # the boundary of this set: higher points cannot fit either
    if exclusive:
        sweep.run_exclusive()
    return sweep.state
