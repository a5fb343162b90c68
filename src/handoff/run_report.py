"""What a training run writes and prints: metrics, progress, planned vs measured, timeline.

    report = RunReport(plan, out_dir, rates=rates, meter=meter, kv_pool_bytes=pool_bytes)
    report.start(first_step)       # first, the compiled layers' decision and its reason
    report.log_step(row)           # metrics.jsonl + run.loggers + one console line
    report.log_samples(step, [(prompt, completion, reward), ...])   # samples.jsonl + loggers
    summary = report.finish()      # summary.{md,json}, memory_timeline.{jsonl,png}, a table

The planned column is the ledger (handoff.plan.ledger) for this model and these offloads,
fed with the rates this run measured at its start (handoff.calibrate), so the gap between
the columns is the runtime's own; the KV wake alone is priced at the run's wake before
(map_priced_at_last_wake), its start price beside it. Its exposed seconds (what of the
switch the step waits for, memory.overlap) hide behind the trainer's compute the plan
models for the tokens this run trained on, and behind the generation time this run
measured; they stand beside the measured `switch/exposed_s`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from handoff.calibrate import Rates
from handoff.config import to_dict
from handoff.console import table_console
from handoff.loggers import Loggers, open_loggers
from handoff.memory.meter import MemoryMeter
from handoff.plan.hardware import HardwareProfile
from handoff.plan.ledger import SWITCH_ACTIONS, switch_actions
from handoff.plan.lora import BaseCopies, lora_switch_actions
from handoff.plan.trainer import exposed_behind_compute
from handoff.reading import expect, read_json
from handoff.run_dir import read_metrics
from handoff.runplan import RunPlan
from handoff.safe_files import append_line, failing_write_is_one_line, replace_file
from handoff.units import fmt_bytes

console = table_console()


def planned_actions(plan: RunPlan, rates: Rates, hw: HardwareProfile,
                    kv_pool_bytes: int) -> dict[str, dict]:
    """The ledger's nine actions for this run, priced with `hw`, the profile with the rates
    measured in it (`rates.profile(plan.hardware)`: a rate it could not measure keeps the
    profile's). The worker's sync is in-process on every rank (no IPC), whatever the shard
    group."""
    cfg, lora = plan.cfg, plan.cfg.actor.lora
    if not lora.rank:
        parallel = dataclasses.replace(cfg.parallel, gpus=max(cfg.parallel.gpus, 1))
        actions = switch_actions(plan.shape, parallel, cfg.memory, hw,
                                 kv_pool_bytes=kv_pool_bytes, dtypes=plan.dtypes, ref=plan.ref,
                                 bucket_bytes=cfg.sync.bucket_mb << 20, in_process=True,
                                 weights_map_bps=rates.get("weights_map_bps"),
                                 h2d_bps=rates.get("h2d_bps"), elastic_pool=plan.elastic_pool,
                                 updates_per_step=cfg.actor.updates_per_step)
    else:   # the base never changes: the KV's sleep and wake, the adapters' sync (and a base
        # held twice backed up and restored)
        bases = BaseCopies.of_run(plan.shape, lora, cfg.memory, cfg.parallel, plan.dtypes)
        actions = lora_switch_actions(plan.shape, cfg.memory, hw,
                                      rank=lora.rank, targets=lora.target_modules,
                                      kv_pool_bytes=kv_pool_bytes, dtypes=plan.dtypes,
                                      elastic_pool=plan.elastic_pool, bases=bases,
                                      h2d_bps=rates.get("h2d_bps"))
    return {a.name: {"bytes": a.bytes_per_card, "seconds": a.seconds, "link": a.link}
            for a in actions}


def planned_exposure(plan: RunPlan, hw: HardwareProfile, planned: dict[str, dict], *,
                     train_tokens: float, generation_seconds: float) -> dict[str, float]:
    """Each planned action's exposed seconds (plan.ledger.exposed_seconds) in this run: the
    copies back hide behind the trainer's forwards plan.trainer models for `train_tokens`
    (a step's prompt + response tokens on this card), the copies to the host (elastic pool)
    behind `generation_seconds`, a step's measured generation."""
    cfg = plan.cfg
    return exposed_behind_compute(
        {a: p["seconds"] for a, p in planned.items()}, cfg.memory, plan.shape, train_tokens,
        hw, ref=plan.ref,
        updates_per_step=cfg.actor.updates_per_step, generation_seconds=generation_seconds,
        elastic_pool=plan.elastic_pool, lora=cfg.actor.lora.rank > 0,
        lora_order=cfg.actor.lora.shares_base)[1]


class RunReport:
    """Rank 0's view of a run: files under out_dir and the console."""

    def __init__(self, plan: RunPlan, out_dir: Path, *, rates: Rates, meter: MemoryMeter,
                 kv_pool_bytes: int, rows: list[dict] = ()):
        """`rows`: metrics.jsonl's rows of the steps before this run's first (a resumed run's
        summary covers the whole run; run_dir.trim_metrics gives them)."""
        self.cfg = plan.cfg
        self.out_dir = out_dir
        self.meter = meter
        self.rows: list[dict] = list(rows)
        self.rates = rates.values
        # The pool as its wake maps it: CUDA maps whole allocator segments (2 MiB-rounded),
        # a little more than the pool's tensors.
        self.plan = plan
        self.hw = rates.profile(plan.hardware)
        self.planned = planned_actions(plan, rates, self.hw, kv_pool_bytes)
        self.metrics_path = out_dir / "metrics.jsonl"
        self.compile = plan.compile_on(meter.device.type)   # what the actor was built with
        self._loggers: Loggers | None = None
        self._progress: Progress | None = None

    def start(self, first_step: int) -> None:
        console.print(self.compile.text(), markup=False, highlight=False)
        with self._writing(self._loggers_path()):
            self._loggers = open_loggers(self.cfg, self.out_dir, first_step=first_step)
            self._loggers.log_config(to_dict(self.cfg))
        self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.description}"),
                                  console=console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task("", total=self.cfg.run.steps, completed=first_step)

    def _loggers_path(self) -> Path:
        """What the loggers write, for a failed write's line (an OSError names its own file)."""
        return self.out_dir / ("tensorboard" if self.cfg.run.loggers == ["tensorboard"] else "")

    def _writing(self, path: Path):
        """Where a write to `path` fails (a full disk, a read-only out_dir): one line."""
        return failing_write_is_one_line(path, f"metrics.jsonl keeps its {len(self.rows)} "
                                               "row(s) and the last checkpoint is intact")

    def log_step(self, row: dict) -> None:
        with self._writing(self.metrics_path):   # the row whole or not at all
            append_line(self.metrics_path, self.out_dir, (json.dumps(row) + "\n").encode())
        self.rows.append(row)
        if self._loggers is not None:
            with self._writing(self._loggers_path()):
                self._loggers.log_metrics(row, row["step"])
        line = step_line(row, kl=self.cfg.actor.kl_coef > 0)
        if self._progress is not None:
            self._progress.console.print(line, highlight=False)
            self._progress.update(self._task, completed=row["step"],
                                  description=f"reward {row['reward_mean']:.3f}")

    def log_samples(self, step: int, samples: list[tuple[str, str, float]]) -> None:
        """A few of step `step`'s (prompt, completion, reward), counted from 1 like the rows:
        samples.jsonl and the loggers' text (run.log_samples of them)."""
        if self._loggers is not None:
            with self._writing(self._loggers_path()):
                self._loggers.log_samples(step, samples)

    # ---------------------------------------------------------------- the end

    def _measured(self) -> dict[str, dict]:
        """Per action: median seconds and bytes over the run's steps (the first is warm-up)."""
        rows = self.rows[1:] or self.rows
        out = {}
        for a in SWITCH_ACTIONS:
            secs = [r.get(f"switch/{a}/seconds", 0.0) for r in rows]
            nbytes = [r.get(f"switch/{a}/bytes", 0) for r in rows]
            out[a] = {"seconds": statistics.median(secs), "bytes": int(statistics.median(nbytes))}
        return out

    def finish(self) -> dict:
        if self._progress is not None:
            self._progress.stop()
        if self._loggers is not None:
            with self._writing(self._loggers_path()):
                self._loggers.close()
        measured = self._measured()
        rows = self.rows[1:] or self.rows
        self.planned["kv_cache_wake"] = map_priced_at_last_wake(
            self.planned["kv_cache_wake"], self.rows)

        def median(key: str) -> float:
            return statistics.median(r.get(key, 0.0) for r in rows) if rows else 0.0

        step_s, host_s = median("timing_s/step"), median("timing_s/host")
        flush_s, queue_s = median("switch/flush_s"), median("switch/queue_s")
        switch_s = sum(m["seconds"] for m in measured.values())
        exposure = planned_exposure(self.plan, self.hw, self.planned,
                                    train_tokens=median("train_tokens"),
                                    generation_seconds=median("timing_s/gen"))
        for action, seconds in exposure.items():
            self.planned[action]["exposed_seconds"] = seconds
        k = max(1, len(self.rows) // 4)
        summary = {
            "steps": len(self.rows), "rates": self.rates, "planned": self.planned,
            "compile": self.compile.to_dict(),
            "measured": measured, "step_seconds": step_s, "switch_seconds": switch_s,
            "switch_share": switch_s / step_s if step_s else None,
            # The measured exposed time holds host work the ledger does not price: the step's
            # own (its prompts and their scoring), the switch's cache flushes (a device sync
            # and the allocator's frees each) and the compute's idle time while the host
            # queues the copies back (their storages allocated in memory the driver clears
            # first, beyond what the first micro-batch covers). The plan adds them as
            # measured, like generation's seconds.
            "host_seconds": host_s, "flush_seconds": flush_s, "queue_seconds": queue_s,
            "planned_exposed_seconds": sum(exposure.values()) + host_s + flush_s + queue_s,
            "exposed_seconds": median("switch/exposed_s"), "raw_seconds": median("switch/raw_s"),
            "lora": _lora_text(self.cfg),
            "decode_seconds": median("engine/decode_s"),
            "decode_over_floor": _median_of(rows, "engine/decode_over_floor"),
            "reward_first": statistics.mean(r["reward_mean"] for r in self.rows[:k]) if self.rows else None,
            "reward_last": statistics.mean(r["reward_mean"] for r in self.rows[-k:]) if self.rows else None,
        }
        last_step = self.rows[-1]["step"] - 1 if self.rows else 0
        files = {**self.meter.report_files(last_step),
                 "summary.md": summary_markdown(summary, self.cfg.model.path,
                                                str(self.meter.device)).encode(),
                 "summary.json": json.dumps(summary, indent=1).encode()}
        for name, data in files.items():   # each whole or not at all, none through a link
            with self._writing(self.out_dir / name):
                replace_file(self.out_dir / name, data, self.out_dir)
        console.print(summary_table(summary))
        return summary


def map_priced_at_last_wake(planned: dict, rows: list[dict]) -> dict:
    """The KV wake's ledger entry priced, for each step after the first, at the rate of the
    wake of the step before (rows in step order; a step whose step before is missing or
    mapped nothing, and a run of one step: at the start's rate). A resumed run's first step
    is priced at the last wake before the resume.

    No rate measured at start predicts a wake's map: it depends on what the driver did with
    the pages since they were last mapped (docs/PERF.md, "The elastic KV pool": pages the
    trainer has just handed back map 2-3x faster than rested ones, and a large hand-back
    makes a map 10x slower). The start maps rested pages; every wake of a run maps after
    the same hand-back, so the last wake's rate is the one that predicts the next. The
    start's price stays beside it, as `start_seconds`."""
    start = planned["seconds"]
    prices = []
    for before, row in zip(rows, rows[1:]):
        secs, nbytes = before.get("switch/kv_cache_wake/seconds", 0.0), \
            before.get("switch/kv_cache_wake/bytes", 0)
        known = secs > 0 and nbytes > 0 and before.get("step", 0) + 1 == row.get("step", 0)
        prices.append(planned["bytes"] * secs / nbytes if known else start)
    # prices[i] is row i + 1's: the same steps as the measured median's (rows[1:])
    seconds = statistics.median(prices) if prices else start
    return {**planned, "seconds": seconds, "start_seconds": start}


def _median_of(rows: list[dict], key: str) -> float | None:
    """The median of `key` over the rows that have it (None: none has)."""
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def _lora_text(cfg) -> str | None:
    """What the summary says of LoRA (None: full-parameter training)."""
    lora = cfg.actor.lora
    if not lora.rank:
        return None
    base = ("the base held once (the engine's weights)" if lora.share_base
            else "the base held twice (trainer and engine)")
    return f"LoRA rank {lora.rank} (alpha {lora.alpha:g}), {base}"


def step_line(row: dict, *, kl: bool) -> str:
    """A step's console line; `kl` only with a reference model (actor.kl_coef > 0)."""
    kl_text = f"kl {row.get('kl', 0.0):.4f}  " if kl else ""
    return (f"step {row['step']:>3}  reward {row['reward_mean']:.3f}±{row['reward_std']:.3f}  "
            f"len {row['response_length']:.1f}  {kl_text}"
            f"gen {row['timing_s/gen']:.2f}s  step {row['timing_s/step']:.2f}s  "
            f"switch {_switch_text(row)}")


# The exposed switch is what the step waits for, so it also holds host work the actions'
# own seconds do not: said whenever it is the larger, lest it read as a measuring error.
HOST_WORK = "includes host work: scoring, flushes, queueing"


def _switch_text(row: dict) -> str:
    """A step row's switch: its actions' seconds and, where the row has it, the exposed part."""
    raw = row.get("switch/raw_s", sum(row.get(f"switch/{a}/seconds", 0.0) for a in SWITCH_ACTIONS))
    exposed = row.get("switch/exposed_s")
    if exposed is None:
        return f"{raw:.2f}s"
    why = f", {HOST_WORK}" if exposed > raw else ""
    return f"{raw:.2f}s (exposed {exposed:.2f}s{why})"


def _totals(s: dict) -> list[tuple[str, dict, dict]]:
    """The summary's total rows as (name, planned, measured) {"seconds"}: all actions' own
    seconds, and the part the step waits for (summaries before memory.overlap have none)."""
    if "exposed_seconds" not in s:
        return []
    planned_raw = sum(s["planned"][a]["seconds"] for a in SWITCH_ACTIONS)
    return [("switch, raw", {"seconds": planned_raw}, {"seconds": s["raw_seconds"]}),
            ("switch, exposed", {"seconds": s["planned_exposed_seconds"]},
             {"seconds": s["exposed_seconds"]})]


def _exposed_text(planned: dict) -> str:
    return f"{planned['exposed_seconds']:.4f}" if "exposed_seconds" in planned else "-"


def _caption(s: dict) -> str:
    exposed = ""
    if "exposed_seconds" in s:
        why = f", {HOST_WORK}" if s["exposed_seconds"] > s.get("raw_seconds", math.inf) else ""
        exposed = f" (exposed {s['exposed_seconds']:.2f} s{why})"
    lora = f"{s['lora']}; " if s.get("lora") else ""
    return (f"{lora}switch {s['switch_seconds']:.2f} s{exposed} of a {s['step_seconds']:.2f} s step "
            f"({_share(s)}); reward {s['reward_first']:.3f} (first quarter) -> "
            f"{s['reward_last']:.3f} (last quarter)")


def summary_table(s: dict) -> Table:
    """The planned-vs-measured table of a run's summary (summary.json)."""
    t = Table(title=f"switch actions: planned (ledger at measured rates) vs measured, "
                    f"median of {max(s['steps'] - 1, 1)} step(s)")
    t.add_column("action", no_wrap=True, min_width=19)
    for col in ("planned bytes", "measured bytes", "planned s", "measured s", "measured/planned",
                "planned exposed s"):
        t.add_column(col, justify="right")
    for a in SWITCH_ACTIONS:
        p, m = s["planned"][a], s["measured"][a]
        t.add_row(a, fmt_bytes(p["bytes"]), fmt_bytes(m["bytes"]), f"{p['seconds']:.4f}",
                  f"{m['seconds']:.4f}", _ratio(p, m), _exposed_text(p))
    for name, p, m in _totals(s):
        t.add_row(name, "", "", f"{p['seconds']:.4f}", f"{m['seconds']:.4f}", _ratio(p, m), "")
    wake = s["planned"]["kv_cache_wake"]
    at_start = (f"; kv_cache_wake planned at the run's wake before (at the start's rate "
                f"{wake['start_seconds']:.4f} s)" if "start_seconds" in wake else "")
    t.caption = _caption(s) + at_start
    return t


def summary_markdown(s: dict, model: str, device: str) -> str:
    """summary.md: the same table as Markdown, with the rates it was priced at."""
    r = s["rates"]
    lines = [
        f"# Run summary: {model}", "", *([f"{s['lora']}.", ""] if s.get("lora") else []),
        f"{s['steps']} steps on {device}; link rates measured at start: "
        f"D2H {r['d2h_bps'] / 1e9:.1f} GB/s, H2D {r['h2d_bps'] / 1e9:.1f} GB/s"
        f"{_kernel_text(r)}, "
        f"device copy {r['d2d_bps'] / 1e9:.1f} GB/s{_remap_text(r)}.", "",
        "| action | planned bytes | measured bytes | planned s | measured s | measured/planned "
        "| planned exposed s |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in SWITCH_ACTIONS:
        p, m = s["planned"][a], s["measured"][a]
        lines.append(f"| {a} | {p['bytes']} | {m['bytes']} | {p['seconds']:.4f} | "
                     f"{m['seconds']:.4f} | {_ratio(p, m)} | {_exposed_text(p)} |")
    for name, p, m in _totals(s):
        lines.append(f"| {name} | | | {p['seconds']:.4f} | {m['seconds']:.4f} | "
                     f"{_ratio(p, m)} | |")
    host = (f", of which {s['host_seconds']:.3f} s the step's own host work, measured: its "
            "prompts and their scoring" if s.get("host_seconds") else "")
    if s.get("flush_seconds"):
        host += (f"{',' if host else ', of which'} {s['flush_seconds']:.3f} s the switch's "
                 "cache flushes, measured")
    if s.get("queue_seconds"):
        host += (f"{',' if host else ', of which'} {s['queue_seconds']:.3f} s idle while the "
                 "copies back were queued, measured")
    exposed = (f", {s['exposed_seconds']:.3f} s of it exposed (the step waits for it; "
               f"planned {s['planned_exposed_seconds']:.3f} s{host})"
               if "exposed_seconds" in s else "")
    lines += ["", *_map_lines(s), f"Switch: {s['switch_seconds']:.3f} s of a "
                  f"{s['step_seconds']:.3f} s step ({_share(s)}){exposed}.",
              *([f"Decode: {s['decode_seconds']:.3f} s a step, {s['decode_over_floor']:.2f}x its "
                 "HBM floor (the weights read once a decode step and every running sequence's "
                 "K/V once, at the device copy rate)."] if s.get("decode_over_floor") else []),
              f"Mean reward: {s['reward_first']:.3f} over the first quarter of steps, "
              f"{s['reward_last']:.3f} over the last.", ""]
    if "compile" in s:   # runs before actor.compile=auto have none
        on = "on" if s["compile"]["on"] else "off"
        lines[-1:] = [f"Compiled layers: {on} ({s['compile']['reason']}).", ""]
    return "\n".join(lines)


def _map_lines(s: dict) -> list[str]:
    """What the KV wake's planned seconds are (summaries before map_priced_at_last_wake lack
    `start_seconds`)."""
    p, m = s["planned"]["kv_cache_wake"], s["measured"]["kv_cache_wake"]
    if "start_seconds" not in p:
        return []
    at_start = {"seconds": p["start_seconds"]}
    return [f"kv_cache_wake is planned at the rate of the run's wake before (a map's rate "
            f"depends on what the pages did since: docs/PERF.md, \"The elastic KV pool\"); at "
            f"the rate mapped at start it was {p['start_seconds']:.4f} s, measured/planned "
            f"{_ratio(at_start, m)}.", ""]


def _remap_text(r: dict) -> str:
    """The remap rates and the per-tensor sync cost of a summary's rates (older runs lack them)."""
    text = ""
    if "map_bps" in r:
        text += (f", map {r['map_bps'] / 1e9:.0f} GB/s and unmap {r['unmap_bps'] / 1e9:.0f} GB/s "
                 f"(a {fmt_bytes(r['remap_bytes'])} region)")
    if "weights_map_bps" in r:
        text += (f", map {r['weights_map_bps'] / 1e9:.0f} GB/s at the weights' "
                 f"{fmt_bytes(r['weights_remap_bytes'])}")
    if "sync_copy_bps" in r:
        text += f", the sync's copies at {r['sync_copy_bps'] / 1e9:.0f} GB/s"
    if "tensor_host_s" in r:
        text += f", {r['tensor_host_s'] * 1e6:.1f} us of host work per synced tensor"
    if "adapter_tensor_s" in r:
        text += f", {r['adapter_tensor_s'] * 1e6:.1f} us per adapter tensor of the LoRA sync"
    return text


def _kernel_text(r: dict) -> str:
    """The kernel-driven H2D rate, where the run measured one (CUDA)."""
    if "h2d_kernel_bps" not in r:
        return ""
    return f" ({r['h2d_kernel_bps'] / 1e9:.1f} GB/s by kernel, as after the engine's sleep)"


def _ratio(planned: dict, measured: dict) -> str:
    """measured / planned seconds of one action ("-" where either is 0)."""
    if planned["seconds"] > 0 and measured["seconds"] > 0:
        return f"{measured['seconds'] / planned['seconds']:.2f}"
    return "-"


def _share(s: dict) -> str:
    """The switch's share of the step, as a percentage."""
    return f"{100 * s['switch_share']:.1f}%" if s["switch_share"] is not None else "-"


SHOWN_KEYS = ("reward_mean", "response_length", "timing_s/gen", "timing_s/step")
# Every number a row of the table reads: the shown keys, kl, and the switch's seconds.
_ROW_NUMBERS = (*SHOWN_KEYS, "kl", "switch/raw_s", "switch/exposed_s",
                *(f"switch/{a}/seconds" for a in SWITCH_ACTIONS))


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")


def _report_rows(run_dir: Path, metrics_path: Path) -> tuple[list[dict], list[str]]:
    """metrics.jsonl's rows for the table, one per step in step order (a step logged twice,
    by a resume that ran it again: its later record), and the notes to print first. A row
    that lacks a field shows "-" there; a field of the wrong type is one line (HandoffError)."""
    from handoff.errors import HandoffError

    if not metrics_path.is_file():
        why = (" (no such directory)" if not run_dir.exists() else
               " (a file, not a run directory)" if not run_dir.is_dir() else "")
        raise HandoffError(f"{run_dir} holds no metrics.jsonl{why}: pass the run.out_dir of a "
                           "`handoff train` run")
    try:
        rows, problem = read_metrics(metrics_path)
    except OSError as e:
        raise HandoffError(f"cannot read {metrics_path} ({e.strerror or e}): pass a run "
                           "directory you can read") from None
    notes = [problem] if problem else []
    by_step: dict[int, dict] = {}
    repeated = set()
    for row in rows:
        if row["step"] in by_step:
            repeated.add(row["step"])
        by_step[row["step"]] = row   # the later record wins: a resume ran the step again
    if repeated:
        notes.append(f"{metrics_path}: steps {_steps_text(sorted(repeated))} appear more than "
                     "once (a resumed run ran them again): the later record of each is shown")
    rows = [{k: v for k, v in by_step[step].items() if v is not None}   # null: as absent
            for step in sorted(by_step)]
    for row in rows:   # a row edited by hand: one line naming the step and the field
        for key in _ROW_NUMBERS:
            expect(row, key, (int, float), source=f"{metrics_path} (step {row['step']})",
                   default=None)
    for key in SHOWN_KEYS:
        lacking = [r["step"] for r in rows if key not in r]
        if lacking:
            notes.append(f"{metrics_path}: {len(lacking)} row(s) lack {key!r} (steps "
                         f"{_steps_text(lacking)}): shown as -")
    if not rows and not problem:
        notes.append(f"{metrics_path} holds no steps yet")
    return rows, notes


def _cell(row: dict, key: str, form: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, form)


def show_run(run_dir: str | Path) -> dict:
    """`handoff report RUN_DIR`: the per-step metrics and the planned-vs-measured table."""
    from handoff.errors import HandoffError

    run_dir = Path(run_dir)
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    rows, notes = _report_rows(run_dir, metrics_path)
    for note in notes:
        console.print(f"[yellow]{escape(note)}[/]", highlight=False, soft_wrap=True)
    t = Table(title=escape(f"{run_dir}: {len(rows)} steps"))
    kl = any(r.get("kl") for r in rows)   # a run without a reference model logs kl 0 only
    for col in ("step", "reward", "length", *(("kl",) if kl else ()), "gen s", "switch s",
                "step s"):
        t.add_column(col, justify="right")
    for r in rows:
        switch = _switch_text(r) if any(k.startswith("switch/") for k in r) else "-"
        t.add_row(str(r["step"]), _cell(r, "reward_mean", ".3f"),
                  _cell(r, "response_length", ".1f"),
                  *((f"{r.get('kl') or 0.0:.4f}",) if kl else ()), _cell(r, "timing_s/gen", ".2f"),
                  switch, _cell(r, "timing_s/step", ".2f"))
    console.print(t)
    if not summary_path.is_file():
        console.print("[yellow]no summary.json: the run did not finish[/]")
        return {}
    try:
        summary = read_json(summary_path, max_bytes=16 << 20)
        console.print(summary_table(summary))
    except HandoffError as e:
        console.print(f"{e}: its table is not shown", style="yellow", highlight=False,
                      markup=False, soft_wrap=True)
        return {}
    except (KeyError, TypeError, ValueError) as e:   # a field missing or of another type
        console.print(f"[yellow]{escape(str(summary_path))} is damaged (field {e}: not the summary of a "
                      "finished run): its table is not shown[/]", highlight=False)
        return {}
    return summary
