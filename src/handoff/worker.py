"""The switch: one device's actor, reference and engine, and the moves that hand the memory
from one to the other. Every move returns a SwitchRecord of what it did.

    worker, rates = start_worker(cfg)                 # handoff.startup
    outs = worker.generate(prompts, params)           # engine awake, trainer state on the host
    record = worker.to_train()                        # engine.sleep(2), actor params back
    logprobs, moves = worker.log_probs(batch)         # old (if needed) and ref log-probs
    metrics, opt = worker.update(batch)               # optimizer back, the GRPO update
    record = worker.to_rollout()                      # the switch back (order below)
    landed = worker.take_landed()                     # copies that landed after their move

The order of both switches, and why it is that order, is in docs/ARCHITECTURE.md ("The
switch"). Every point is a meter probe under the source's names, and every action is timed
under the ledger's name (handoff.plan.ledger.SWITCH_ACTIONS) with the bytes it moved, so a
run prints planned vs measured side by side. Offloads the config turns off are skipped and
recorded as 0 bytes.

With memory.overlap (the streamed switch) some copies outlive the move that starts them: the
optimizer's copy back lands inside the update, and with an elastic KV pool the copies to
the host land between the next generation's engine steps. A copy is recorded in the record
of the move it lands in, or, landing outside one (generation, `settle`), in `take_landed()`:
either way in the step it lands in. `work` holds the step's generation and trainer compute
seconds by phase (less their waits for copies, which `copy_wait_seconds` adds up);
`work_seconds` is their sum, the rest of the step is the switch's exposed time.

Under torchrun each rank runs one worker: the trainer's FSDP2 mesh spans every rank, and
the engines of parallel.tp consecutive ranks form one tensor-parallel engine (each rank
sleeps, wakes and loads its own shard; every rank sends its engine all full params).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from rich.console import Console

from handoff.config import Config
from handoff.dist import ComputeGap, wait_for_compute, world_rank_size
from handoff.errors import HandoffError
from handoff.memory.allocator import aggressive_empty_cache, device_free_bytes, expandable_segments
from handoff.memory.meter import MemoryMeter
from handoff.memory.regions import RegionPool
from handoff.memory.staging import Transfer
from handoff.plan.ledger import SWITCH_ACTIONS
from handoff.rollout.engine import Engine
from handoff.sync.weights import SyncStats, sync_weights
from handoff.train.actor import Actor
from handoff.train.batch import RolloutBatch
from handoff.train.model import Move, ShardedModel
from handoff.units import fmt_bytes

T = TypeVar("T")
_console = Console(stderr=True)


@dataclass
class _PassHooks:
    """model.PassHooks from two functions."""

    inputs_ready: Callable[[list], None]
    first_launched: Callable[[], None]


# The probe names of one step, in order (the source's "before resume weights" etc.).
PROBES_TO_TRAIN = ("after generate", "after engine sleep", "after params onload",
                   "after ref forward")
PROBES_TO_ROLLOUT = ("after update", "before resume weights", "after update_weights",
                     "after params offload", "after resume kv_cache")


@dataclass
class Action:
    """One ledger action as measured: seconds on its clock and bytes moved."""

    seconds: float = 0.0
    bytes: int = 0


@dataclass
class SwitchRecord:
    """What a move of the worker did: its ledger actions, and for the switch back to rollout
    the weight sync's stats and the time the weights' region took to map."""

    actions: dict[str, Action] = field(default_factory=dict)
    sync: SyncStats | None = None
    weights_wake_seconds: float = 0.0

    def add(self, action: str, seconds: float, nbytes: int) -> None:
        entry = self.actions.setdefault(action, Action())
        entry.seconds += seconds
        entry.bytes += int(nbytes)

    def add_moves(self, moved: dict[str, dict], direction: str) -> None:
        """A `ShardedModel.to(...).wait()` result, part by part, as `<part>_<direction>`."""
        for part, r in moved.items():
            self.add(f"{part}_{direction}", r["seconds"], r["bytes"])

    @classmethod
    def merged(cls, records: list["SwitchRecord"]) -> "SwitchRecord":
        """A step's records as one: every ledger action present (0 s / 0 B when it did not
        run, so a step's metrics keep one shape), the sync of the one that synced."""
        out = cls(actions={a: Action() for a in SWITCH_ACTIONS})
        for r in records:
            for name, a in r.actions.items():
                out.add(name, a.seconds, a.bytes)
            if r.sync is not None:
                out.sync, out.weights_wake_seconds = r.sync, r.weights_wake_seconds
        return out


class HybridWorker:
    """One device's actor + reference + engine, handing the memory over twice per step.

    Built by handoff.startup.start_worker, which puts the trainer's state where the rollout
    phase keeps it, measures the rates, then builds the engine."""

    def __init__(self, cfg: Config, *, actor: Actor, ref: ShardedModel | None, engine: Engine,
                 pool: RegionPool, meter: MemoryMeter):
        self.cfg = cfg
        self.device = pool.device
        self.actor, self.ref, self.engine = actor, ref, engine
        self.pool, self.meter = pool, meter
        self.step = -1  # probes before the first step carry step -1
        self.work: dict[str, float] = {}   # this step's work seconds by phase (module docstring)
        self.copy_wait_seconds = 0.0       # this step's compute waits for copies
        self.flush_seconds = 0.0           # this step's cache flushes outside compute
        self.gemms_warmed = 0              # this step's GEMM shapes launched before copies
        self.queue_seconds = 0.0           # this step's compute idle queueing the copies back
        self._queue_gaps: list[tuple[ComputeGap, float]] = []   # (gap, copy waits inside it)
        self._to_host: list[tuple[str, Transfer]] = []   # (ledger action, copy), in stream order
        self._queued_to_host: list[str] = []   # parts whose D2H starts in _land_between_steps
        self._landed = SwitchRecord()          # copies that landed outside a move
        self._grow_due = False                 # landed memory not yet handed to the KV pool
        self._ref_back: Move | None = None           # streamed: queued by to_train
        self._due_back: list[str] = []   # streamed: actor parts queued at the next forward
        self._coming_back: dict[str, Move] = {}     # actor parts' copies back, not yet waited
        self._between_steps_seconds = 0.0
        self._said: set[str] = set()
        mem = cfg.memory
        if mem.overlap and not self._streams_to_host() and (mem.param_offload
                                                            or mem.optimizer_offload):
            self._say_once("fixed pool", "memory.overlap: the fixed KV pool is mapped whole at "
                           "its wake, so the copies to the host are waited for before it and "
                           "generation does not start under them; rollout.kv_pool=elastic "
                           "streams them behind generation")
        self.probe("start")

    def probe(self, name: str) -> dict:
        return self.meter.probe(name, step=self.step)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.work = {}
        self.copy_wait_seconds = 0.0
        self.flush_seconds = 0.0
        self.gemms_warmed = 0
        self.queue_seconds = 0.0

    @property
    def work_seconds(self) -> float:
        return sum(self.work.values())

    def _add_work(self, phase: str, seconds: float) -> None:
        self.work[phase] = self.work.get(phase, 0.0) + seconds

    def _flush(self) -> None:
        """aggressive_empty_cache() in the switch, outside compute: its seconds (a device sync
        and the allocator's frees: host work the ledger does not price) are `flush_seconds`."""
        t0 = time.perf_counter()
        aggressive_empty_cache()
        self.flush_seconds += time.perf_counter() - t0

    def _say_once(self, key: str, text: str) -> None:
        """One line on stderr (rank 0), the first time `key` comes up in this worker."""
        if key not in self._said:
            self._said.add(key)
            if world_rank_size()[0] == 0:
                _console.print(f"[yellow]{text}[/]", highlight=False, soft_wrap=True)

    def _offloaded(self, *parts: str) -> list[str]:
        """Those of the actor's `parts` ("params", "optimizer") the config offloads, in order."""
        mem = self.cfg.memory
        on = {"params": mem.param_offload, "optimizer": mem.optimizer_offload}
        return [part for part in parts if on[part]]

    def _streams_to_host(self) -> bool:
        """Whether generation starts while the copies to the host run: memory.overlap with an
        elastic KV pool (a fixed one must be mapped whole at its wake)."""
        return self.cfg.memory.overlap and self.engine.elastic

    def _timed(self, record: SwitchRecord, action: str, fn: Callable[[], T],
               nbytes: Callable[[], int] = lambda: 0) -> T:
        """Run `fn` as ledger action `action`: wall seconds from an idle compute stream to the
        end of its work on it (copies on other streams run on)."""
        wait_for_compute(self.device)
        t0 = time.perf_counter()
        result = fn()
        wait_for_compute(self.device)
        record.add(action, time.perf_counter() - t0, nbytes())
        return result

    def _compute(self, phase: str, fn: Callable[[], T]) -> T:
        """Run trainer compute `fn`; its wall time, less its waits for copies and the compute's
        idle time while the host queued copies back in it (`_copies_beside`), is `phase`'s
        work."""
        wait_for_compute(self.device)
        waited, queued = self._copy_waits(), self.queue_seconds
        t0 = time.perf_counter()
        result = fn()
        wait_for_compute(self.device)
        for gap, gap_waited in self._queue_gaps:   # a wait is the compute's copy wait already
            self.queue_seconds += max(gap.seconds() - gap_waited, 0.0)
        self._queue_gaps = []
        waited = self._copy_waits() - waited
        self.copy_wait_seconds += waited
        self._add_work(phase, time.perf_counter() - t0 - waited - (self.queue_seconds - queued))
        return result

    def _copy_waits(self) -> float:
        return self.actor.copy_wait_seconds + (self.ref.copy_wait_seconds if self.ref else 0.0)

    def load_trainer_state(self, load: Callable[[Actor], T]) -> T:
        """Resume: `load(actor)` with the trainer's state on the card, then the normal switch.

        The engine sleeps meanwhile (its weights are stale anyway: it loaded the initial
        checkpoint), and `to_rollout` pushes the resumed weights into it.
        """
        mem = self.cfg.memory
        self.settle()
        self.engine.sleep(2)
        aggressive_empty_cache()
        if mem.param_offload or mem.optimizer_offload:
            self.actor.to("device", params=mem.param_offload,
                          optimizer=mem.optimizer_offload).wait()
        result = load(self.actor)
        self.to_rollout()
        return result

    # ---------------------------------------------------------------- copies to the host

    def _start_to_host(self, part: str) -> None:
        """Start the copy of an actor part to the host (async on CUDA); `_land` lands it."""
        transfer = self.actor.to("host", **{part: True}).transfers[part]
        if transfer is not None:
            self._to_host.append((f"{part}_d2h", transfer))

    def _land(self, record: SwitchRecord, *, wait: bool) -> bool:
        """Land the copies to the host that have finished (wait: all in flight): their device
        memory is freed, their actions recorded. Returns whether any landed."""
        landed = False
        while self._to_host and (wait or self._to_host[0][1].done()):
            action, transfer = self._to_host.pop(0)
            transfer.wait()
            record.add(action, transfer.seconds, transfer.bytes)
            landed = True
        return landed

    def _start_queued_to_host(self) -> None:
        """The next queued part's copy, once the one in flight has landed: the cache emptied
        at a landing then waits for no copy of ours (one D2H stream: no later either)."""
        if self._queued_to_host and not self._to_host:
            self._start_to_host(self._queued_to_host.pop(0))

    def _land_between_steps(self) -> None:
        """Between two engine steps: land the copies that finished and start the next part's
        copy; when the pool holds generation back (engine.kv_short) and no copy of ours is in
        flight, the landed memory goes back to the driver and the KV pool grows into it
        (before the next part's copy starts). Never waits for a copy.

        The hand-over (emptying the cache: a device sync, then the map) costs a tenth of a
        second on the 4B step (docs/PERF.md), so it runs only when generation needs it: with
        a copy in flight the sync would wait for that copy too.

        The first copy starts once a decode step is launched: the launch of a GEMM shape new
        to the process (a prefill's token count) waits for the device to go idle, copies in
        flight included (docs/PERF.md); decode steps replay captured graphs."""
        t0 = time.perf_counter()
        self._grow_due = self._land(self._landed, wait=False) or self._grow_due
        if self._grow_due and not self._to_host and self.engine.kv_short:
            self._grow_due = False
            self._flush()
            before = self.engine.kv_mapped_bytes
            t_grow = time.perf_counter()
            grown = self.engine.grow_kv() - before
            if grown > 0:   # the wake's second map: recorded as kv_cache_wake
                self._landed.add("kv_cache_wake", time.perf_counter() - t_grow, grown)
                self.probe("kv pool grown")   # the timeline shows the pool growing
        if self.engine.decoding:
            self._start_queued_to_host()
        self._between_steps_seconds += time.perf_counter() - t0

    def settle(self) -> None:
        """Wait for every copy to the host still pending and land it: before anything that
        needs the trainer's state on the host or the card back (a checkpoint, a resume, the
        run's end). Their actions go to `take_landed()`."""
        while self.copies_pending:
            self._land(self._landed, wait=True)
            self._flush()
            self._start_queued_to_host()

    @property
    def copies_pending(self) -> bool:
        """A copy of the trainer's state to the host is in flight or queued."""
        return bool(self._to_host or self._queued_to_host)

    def take_landed(self) -> SwitchRecord:
        """The copies that landed outside a move since the last call (generation, `settle`)."""
        record, self._landed = self._landed, SwitchRecord()
        return record

    # ---------------------------------------------------------------- rollout phase

    def generate(self, prompts: list[list[int]], params, *, progress: bool = False):
        """The engine's generation. Copies to the host a streamed switch left running land
        between its steps (their memory grows the KV pool); the rest once it ends."""
        streamed = self.copies_pending
        self._between_steps_seconds = 0.0
        self._grow_due = False
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, params, progress=progress,
                                    between_steps=self._land_between_steps if streamed else None)
        self._add_work("generate", time.perf_counter() - t0 - self._between_steps_seconds)
        self.settle()
        self.probe("after generate")
        return outs

    def to_train(self) -> SwitchRecord:
        """Engine sleep(2) (weights and KV discarded), then the trainer's state comes back.

        In turn (memory.overlap=false): the actor's params, waited for; the ref and the
        optimizer follow in log_probs and update; params and ref come back by kernel: right
        after a large sleep the copy engines run at half rate (docs/PERF.md). Streamed: the
        ref's copy is queued by kernel, not waited for here (the ref's forward waits for it).
        The params' and the optimizer's copies are queued on the copy engines, in that order,
        once the first forward's micro-batch inputs are on the device (a copy of the inputs
        queued behind them would wait for all of them): the ref's forward, which hides both,
        or with no ref the update's. The optimizer's is then behind no backward, whose
        device-to-device copies (FSDP2's, at world size 1) would wait for all of it. When the
        actor's own forward comes first, the params come back by kernel, now (docs/PERF.md,
        "The streamed switch", says what each place cost)."""
        mem = self.cfg.memory
        record = SwitchRecord()
        self._timed(record, "engine_sleep", lambda: self.engine.sleep(2))
        self._flush()
        self.probe("after engine sleep")
        if mem.overlap:
            self._ref_back = self._start_ref_back()
            self._due_back = self._offloaded("params", "optimizer")
            actor_first = self.ref is None or self.cfg.actor.updates_per_step > 1
            if actor_first and self._due_back[:1] == ["params"]:
                self._stream_back(record, self._due_back.pop(0), by_kernel=True)
        elif mem.param_offload:
            record.add_moves(self.actor.to("device", params=True, by_kernel=True).wait(), "h2d")
        self.probe("after params onload")
        return record

    # ---------------------------------------------------------------- training phase

    def log_probs(self, batch: RolloutBatch) -> tuple[dict, SwitchRecord]:
        """{"old": the sampling policy's log-probs, "ref": the reference's} (None where not
        needed), and the record of the ref's moves (loaded only for its forward).

        With one update per step "old" is None: the policy has not moved, so the update's own
        (detached) forward gives them and a pass is saved.

        With memory.overlap the ref's copy back was queued by to_train, the actor's copies
        back are queued once the first forward's inputs are on the device (to_train says
        why), and the ref's device copy is dropped after its forward: it never changes, so the
        host copy of its first offload is still the truth (ref_d2h moves 0 bytes)."""
        mem = self.cfg.memory
        record = SwitchRecord()
        ref_back, self._ref_back = self._ref_back, None
        old = None
        if self.cfg.actor.updates_per_step > 1:
            old = self._compute("old_logprobs", lambda: self.actor.log_probs(
                batch, with_entropy=False, hooks=self._copies_beside(record, self.actor)
            )[0])
        ref = None
        if self.ref is not None:
            if not mem.overlap:
                ref_back = self._start_ref_back()
            if ref_back is not None:
                moved = ref_back.wait()["params"]
                record.add("ref_h2d", moved["seconds"], moved["bytes"])
            ref = self._compute("ref_forward", lambda: self.ref.log_probs(
                batch, with_entropy=False, hooks=self._copies_beside(record, self.ref)
            )[0])
            if mem.ref_offload:
                moved = self.ref.to("host", params=True, copy=not mem.overlap).wait()["params"]
                record.add("ref_d2h", moved["seconds"], moved["bytes"])
        self.probe("after ref forward")   # with no ref too: every step has the same probes
        return {"old": old, "ref": ref}, record

    def _copies_beside(self, record: SwitchRecord, model, *, last: bool = False,
                       backward: bool = False) -> _PassHooks:
        """A pass's hooks (model.PassHooks): the copies back still due are queued beside it.

        Before any forward, its GEMM shapes new to the process are launched (memory.warm_gemms:
        train/gemm_warmup.py says why). The copies are queued once its first micro-batches are
        (PassHooks.first_launched: a shape new to the process among them): queueing allocates
        their storages, which waits for the driver to clear the memory the engine's pool just
        freed (docs/PERF.md), and the device computes meanwhile. The
        warm-up's host time and the compute's idle time while queueing are `queue_seconds`,
        not the pass's work."""
        def inputs_ready(micro_batches: list) -> None:
            if self._due_back and self.cfg.memory.warm_gemms:
                t0 = time.perf_counter()
                self.gemms_warmed += model.warm_gemms(micro_batches, backward=backward)
                self.queue_seconds += time.perf_counter() - t0

        def first_launched() -> None:
            if self._due_back:
                gap, waited = ComputeGap(self.device), self._copy_waits()
                self._stream_due_back(record, last=last)
                gap.close()
                self._queue_gaps.append((gap, self._copy_waits() - waited))
        return _PassHooks(inputs_ready, first_launched)

    def _stream_due_back(self, record: SwitchRecord, *, last: bool = False) -> None:
        """Queue the copies back to_train left for the first forward, in order, on the copy
        engines, while the card has room for them beside it; what has none waits for the
        next forward, or at the `last` (the update's) comes back now."""
        while self._due_back and self._stream_back(record, self._due_back[0], wait=last):
            self._due_back.pop(0)

    def _start_ref_back(self) -> Move | None:
        if self.ref is None or not self.cfg.memory.ref_offload:
            return None
        return self.ref.to("device", params=True, by_kernel=True)

    def _stream_back(self, record: SwitchRecord, part: str, *, by_kernel: bool = False,
                     wait: bool = True) -> bool:
        """Queue the copy back of the actor's offloaded `part`, not waited for: the
        compute that needs it waits (the actor's forward for the params, the update for the
        optimizer). Returns False if it is left for later (below).

        It needs room beside what runs then; the card holds at most what it holds in the
        update (the ref where the grads will be, an activation peak below the update's), so
        only the part's bytes are checked. Without that room it is left for later (`wait`
        False), or comes back now (the sequential order), said once; called inside compute,
        that wait is the compute's wait for a copy."""
        mem = self.cfg.memory
        free = device_free_bytes(self.device)
        need = self.actor.memory_parts()[part] + (mem.wake_margin_mb << 20)
        if free is None or free >= need:
            programs = None
            if part == "optimizer" and mem.optimizer_back_programs:
                by_kernel, programs = True, mem.optimizer_back_programs
            self._coming_back[part] = self.actor.to("device", by_kernel=by_kernel,
                                                    programs=programs, **{part: True})
            return True
        if not wait:
            return False
        self._say_once(f"{part} back", f"memory.overlap: the actor's {part} need "
                       f"{fmt_bytes(need)} beside what the card holds, {fmt_bytes(free)} is "
                       "free: they come back before the compute that needs them instead (the "
                       "sequential order); offload less or lower actor.micro_batch_tokens to "
                       "overlap it")
        t0 = time.perf_counter()
        moved = self.actor.to("device", by_kernel=part == "params", **{part: True}).wait()
        self.actor.copy_wait_seconds += time.perf_counter() - t0
        record.add_moves(moved, "h2d")
        return True

    def update(self, batch: RolloutBatch) -> tuple[dict[str, float], SwitchRecord]:
        """The GRPO update; the optimizer's state comes back right before it unless its copy
        already runs (memory.overlap). Queued under an earlier forward, what is left of it is
        waited for first (the update's inputs would upload behind it), as the compute's wait
        for a copy; with no forward before (or no room beside it), it is queued once the
        update's inputs are on the device and lands inside it, before the optimizer step."""
        record = SwitchRecord()
        hooks = None
        if self.cfg.memory.overlap:
            hooks = self._copies_beside(record, self.actor, last=True, backward=True)
        elif self.cfg.memory.optimizer_offload:
            record.add_moves(self.actor.to("device", optimizer=True).wait(), "h2d")

        def run() -> dict[str, float]:
            if self._due_back[:1] == ["params"]:   # had no room before: the update needs them
                self._stream_back(record, self._due_back.pop(0))
            if "optimizer" in self._coming_back:
                self.actor.require_on_device("optimizer")
            return self.actor.update(batch, hooks=hooks, backward_done=(
                self._flush_activations if self._streams_to_host() else None))

        metrics = self._compute("update", run)
        self._land_coming_back(record)
        self.probe("after update")
        return metrics, record

    def _flush_activations(self) -> None:
        """Streamed, after the last backward: the activations' memory back to the driver (the
        host waits for the device then anyway), which clears what it gets back before it can
        be mapped again; the KV wake comes a few tenths later. The flush waits for every
        stream, so the optimizer's copy is waited for first, as the compute's wait."""
        self.actor.require_on_device("optimizer")
        aggressive_empty_cache()

    def _land_coming_back(self, record: SwitchRecord) -> None:
        """Record the copies back (landed by now: the compute that needed them waited)."""
        for move in self._coming_back.values():
            record.add_moves(move.wait(), "h2d")
        self._coming_back.clear()

    # ---------------------------------------------------------------- the switch back

    def _wake_weights(self, record: SwitchRecord) -> None:
        """Wake the engine's weights while the optimizer copy runs; if the card is too full
        for that, wait for the copy to free the optimizer's memory and try once more."""
        try:
            self.engine.wake_up(["weights"])
        except HandoffError:
            if not self.cfg.memory.optimizer_offload:
                raise
            self._land(record, wait=True)
            self._flush()
            self.engine.wake_up(["weights"])

    def _sync_weights(self, record: SwitchRecord) -> None:
        t0 = time.perf_counter()
        self._wake_weights(record)
        record.weights_wake_seconds = time.perf_counter() - t0
        record.sync = sync_weights(
            self.actor.full_params(self.engine.dtype), self.engine.load_weights,
            bucket_bytes=self.cfg.sync.bucket_mb << 20, device=self.device,
            readback=self.engine.export_weight if self.cfg.sync.verify else None,
            select=self.engine.weight_shard)

    def _hand_back_in_turn(self, record: SwitchRecord) -> None:
        """The copies to the host waited for one after the other, before the KV pool maps."""
        mem = self.cfg.memory
        if mem.optimizer_offload:
            # The optimizer's memory goes back to the driver as soon as its copy ends,
            # while the params' copy (on the same D2H stream, so no later) runs: the
            # driver clears freed pages before it maps them again.
            self._land(record, wait=True)
            self._flush()
        if mem.param_offload:
            self._start_to_host("params")
            self._land(record, wait=True)
        self._flush()

    def _wake_kv_cache(self) -> None:
        """Map the KV pool. Streamed, an elastic pool maps what is free beside the copies
        still running; if not even its least fits there, they land first (said once)."""
        try:
            self.engine.wake_up(["kv_cache"])
        except HandoffError as e:
            if not self.copies_pending:
                raise
            self._say_once("kv wake", f"memory.overlap: the KV pool could not map beside the "
                           f"copies to the host ({e}): they are waited for first (the "
                           "sequential order)")
            self.settle()
            self.engine.wake_up(["kv_cache"])

    def to_rollout(self) -> SwitchRecord:
        """Training -> generation in the switch order of docs/ARCHITECTURE.md."""
        mem = self.cfg.memory
        record = SwitchRecord()
        if "params" in self._due_back:   # a step without training: the sync reads them
            self._stream_back(record, "params", by_kernel=True)
        self._due_back.clear()            # the optimizer, never needed, stays on the host
        self._land_coming_back(record)
        streamed = self._streams_to_host()
        if streamed or not mem.optimizer_offload:
            # Before any copy is queued, emptying waits only for the update's kernels; streamed,
            # the training phase's cached blocks so go back to the driver for the KV wake to map
            # (docs/PERF.md, "The streamed switch").
            self._flush()
        if mem.optimizer_offload and not streamed:
            self._start_to_host("optimizer")
            # Emptying the cache now would wait for the optimizer copy (and free none of its
            # memory: that comes when the copy is waited on): the weights wake tries without
            # it, and _wake_weights waits, empties and retries if it must.
            gc.collect()
        self.probe("before resume weights")
        with expandable_segments(False):
            self._timed(record, "engine_weights_sync", lambda: self._sync_weights(record),
                        nbytes=lambda: record.sync.bytes)
            self.probe("after update_weights")
            if streamed:
                # Generation starts before the copies: they start under it (the optimizer's
                # first, in turn) and land between its steps.
                self._queued_to_host += self._offloaded("optimizer", "params")
            else:
                self._hand_back_in_turn(record)
            self.probe("after params offload")
            # Mapped, not copied: the ledger counts the pool's bytes for this action too.
            self._timed(record, "kv_cache_wake", self._wake_kv_cache,
                        nbytes=lambda: self.pool.region_bytes("kv_cache"))
        self.engine.reset_prefix_cache()
        self.probe("after resume kv_cache")
        return record
