"""HybridWorker: one device's actor, reference and engine, and the phases of a step that
hand the memory from one to the other. Each phase returns what it did.

    worker, rates = start_worker(cfg, plan)           # handoff.startup
    gen = worker.generate(prompts, params)            # Generation: outputs, seconds, engine
    record = worker.to_train()                        # SwitchRecord
    logprobs, record = worker.log_probs(batch)        # old (if needed) and ref log-probs
    metrics, record = worker.update(batch)            # the GRPO update
    record = worker.to_rollout()                      # the switch back
    switch, times = worker.end_step(records)          # the step's SwitchRecord, StepTimes

The worker keeps the phases in their order and follows `plan.order.switch_order` for where
each ledger action runs: the copies that outlive a phase are `switch.copies`, the step's
clock `switch.clock`. Every point is a meter probe under the source's names, and every
action is timed under the ledger's name with the bytes it moved, so a run prints planned vs
measured side by side.

Under torchrun each rank runs one worker: the trainer's FSDP2 mesh spans every rank, and
the engines of parallel.tp consecutive ranks form one tensor-parallel engine (each rank
sleeps, wakes and loads its own shard; every rank sends its engine all full params).
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from rich.console import Console

from handoff.config import Config
from handoff.dist import world_rank_size
from handoff.errors import HandoffError
from handoff.memory.allocator import aggressive_empty_cache, expandable_segments
from handoff.memory.meter import MemoryMeter
from handoff.memory.regions import RegionPool
from handoff.plan.order import Move, switch_order
from handoff.rollout.engine import Engine
from handoff.switch.clock import StepClock, StepTimes
from handoff.switch.copies import CopiesInFlight
from handoff.switch.lora import sleep_engine, sync_lora
from handoff.switch.record import Generation, SwitchRecord
from handoff.sync.weights import kept_bytes, sync_weights
from handoff.trainer.actor import Actor
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.model import ShardedModel

T = TypeVar("T")
_console = Console(stderr=True)

# The probe names of one step, in order (the source's "before resume weights" etc.).
PROBES_TO_TRAIN = ("after generate", "after engine sleep", "after params onload",
                   "after ref forward")
PROBES_TO_ROLLOUT = ("after update", "before resume weights", "after update_weights",
                     "after params offload", "after resume kv_cache")
# Engine counters a step reports as its own share (stats() gives them since start).
ENGINE_COUNTERS = ("preemptions", "decode_steps", "decode_seconds", "prefill_seconds",
                   "decode_read_bytes")


@dataclass
class _PassHooks:
    """model.PassHooks from two functions."""

    inputs_ready: Callable[[list], None]
    first_launched: Callable[[], None]


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
        self.lora_shared = cfg.actor.lora.shares_base   # switch/lora.py: the base never moves
        self.order = switch_order(cfg.memory, ref=ref is not None, elastic_pool=engine.elastic,
                                  updates_per_step=cfg.actor.updates_per_step,
                                  lora=self.lora_shared)
        # Generation starts while the copies to the host run: a fixed pool must be mapped
        # whole at its wake.
        self.streams_to_host = cfg.memory.overlap and engine.elastic
        self.step = -1  # probes before the first step carry step -1
        self.clock = StepClock(self.device, self._copy_waits)
        self._said: set[str] = set()
        self.copies = CopiesInFlight(actor, ref, cfg.memory, clock=self.clock,
                                     say_once=self._say_once)
        self._grow_due = False                 # landed memory not yet handed to the KV pool
        self._between_steps_seconds = 0.0
        mem = cfg.memory
        if mem.overlap and not self.streams_to_host and (mem.param_offload
                                                         or mem.optimizer_offload):
            # The elastic pool is one engine per card: not a fix to offer under TP.
            fix = ("; rollout.kv_pool=elastic streams them behind generation"
                   if cfg.parallel.tp == 1 else "")
            self._say_once("fixed pool", "memory.overlap: the fixed KV pool is mapped whole at "
                           "its wake, so the copies to the host are waited for before it and "
                           f"generation does not start under them{fix}")
        self.probe("start")

    @property
    def tp_size(self) -> int:
        """Ranks that share this worker's engine (parallel.tp)."""
        return self.engine.tp.size

    @property
    def kv_pool_bytes(self) -> int:
        return self.pool.region_bytes("kv_cache")

    def probe(self, name: str) -> dict:
        return self.meter.probe(name, step=self.step)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.clock.begin()

    def end_step(self, records: list[SwitchRecord]) -> tuple[SwitchRecord, StepTimes]:
        """The step's moves as one record (with the copies that landed outside a move), and
        its clock."""
        return SwitchRecord.merged(records + [self.copies.take_landed()]), self.clock.times()

    def _say_once(self, key: str, text: str) -> None:
        """One line on stderr (rank 0), the first time `key` comes up in this worker."""
        if key not in self._said:
            self._said.add(key)
            if world_rank_size()[0] == 0:
                _console.print(text, style="yellow", markup=False, highlight=False,
                               soft_wrap=True)

    def _timed(self, record: SwitchRecord, action: str, fn: Callable[[], T],
               nbytes: Callable[[], int] = lambda: 0) -> T:
        """Run `fn` as ledger action `action` on the clock (StepClock.timed)."""
        result, seconds = self.clock.timed(fn)
        record.add(action, seconds, nbytes())
        return result

    def _copy_waits(self) -> float:
        return self.actor.copy_wait_seconds + (self.ref.copy_wait_seconds if self.ref else 0.0)

    # ---------------------------------------------------------------- trainer state

    def load_trainer_state(self, load: Callable[[Actor], T]) -> T:
        """Resume: `load(actor)` with the trainer's state on the card, then the normal switch.

        The engine sleeps meanwhile (its weights are stale anyway: it loaded the initial
        checkpoint), and `to_rollout` pushes the resumed weights into it.
        """
        mem = self.cfg.memory
        self.settle()
        sleep_engine(self.engine, self.cfg)
        aggressive_empty_cache()
        if mem.param_offload or mem.optimizer_offload:
            self.actor.to("device", params=mem.param_offload,
                          optimizer=mem.optimizer_offload).wait()
        result = load(self.actor)
        self.to_rollout()
        return result

    def save_trainer_state(self, save: Callable[[Actor], T]) -> T:
        """`save(actor)` once no copy of the trainer's state is on its way (a checkpoint)."""
        self.settle()
        return save(self.actor)

    def settle(self) -> None:
        """Land every copy to the host still pending (CopiesInFlight.settle)."""
        self.copies.settle()

    @property
    def copies_pending(self) -> bool:
        return self.copies.pending

    # ---------------------------------------------------------------- rollout phase

    def generate(self, prompts: list[list[int]], params, *, progress: bool = False
                 ) -> Generation:
        """The engine's generation. Copies to the host a streamed switch left running land
        between its steps (their memory grows the KV pool); the rest once it ends."""
        before = self.engine.stats()
        streamed = self.copies.pending
        self._between_steps_seconds = 0.0
        self._grow_due = False
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, params, progress=progress,
                                    between_steps=self._between_engine_steps if streamed
                                    else None)
        self.clock.add_work("generate", time.perf_counter() - t0 - self._between_steps_seconds)
        self.settle()
        self.probe("after generate")
        seconds = time.perf_counter() - t0
        engine = self.engine.stats()
        for counter in ENGINE_COUNTERS:
            engine[counter] -= before[counter]
        return Generation(outs, seconds, engine)

    def reset_prefix_cache(self) -> None:
        """Forget the engine's cached prefixes (after generating outside a step: an
        evaluation's prompts must not change what the next step's prefills compute)."""
        self.engine.reset_prefix_cache()

    def _between_engine_steps(self) -> None:
        """Between two engine steps: land the copies that finished and start the next part's
        copy; when the pool holds generation back (engine.kv_short) and no copy of ours is in
        flight, the landed memory goes back to the driver and the KV pool grows into it
        (before the next part's copy starts). Never waits for a copy.

        The hand-over (emptying the cache: a device sync, then the map) costs a tenth of a
        second on the 4B step (docs/PERF.md), so it runs only when generation needs it: with
        a copy in flight the sync would wait for that copy too.

        The first copy starts once a decode step is launched: the launch of a GEMM shape new
        to the process (a prefill's token count) waits for the device to go idle, copies in
        flight included; decode steps replay captured graphs."""
        t0 = time.perf_counter()
        self._grow_due = self.copies.land_finished() or self._grow_due
        if self._grow_due and not self.copies.in_flight and self.engine.kv_short:
            self._grow_due = False
            self.clock.flush()
            before = self.engine.kv_mapped_bytes
            t_grow = time.perf_counter()
            grown = self.engine.grow_kv() - before
            if grown > 0:   # the wake's second map: recorded as kv_cache_wake
                self.copies.landed.add("kv_cache_wake", time.perf_counter() - t_grow, grown)
                self.probe("kv pool grown")   # the timeline shows the pool growing
        if self.engine.decoding:
            self.copies.start_queued_to_host()
        self._between_steps_seconds += time.perf_counter() - t0

    # ---------------------------------------------------------------- the switch to training

    def to_train(self) -> SwitchRecord:
        """Engine sleep(2) (weights and KV discarded; the KV only under LoRA on a shared base:
        switch/lora.py), then the order's `to_train` moves; the
        `first_pass` ones are left due, queued beside the first pass with room for them."""
        record = SwitchRecord()
        for move in self.order.at("to_train"):
            self._to_train_move(record, move)
        self.copies.due_back = [m.part for m in self.order.at("first_pass")]
        self.probe("after params onload")
        return record

    def _to_train_move(self, record: SwitchRecord, move: Move) -> None:
        if move.action == "engine_sleep":
            self._timed(record, "engine_sleep", lambda: sleep_engine(self.engine, self.cfg),
                        nbytes=self._backed_up_bytes)
            self.clock.flush()
            self.probe("after engine sleep")
        elif move.action == "ref_h2d":   # the ref's forward waits for it
            self.copies.ref_back = self.copies.start_ref_back()
        elif move.how == "wait":
            record.add_moves(self.actor.to("device", by_kernel=move.by_kernel,
                                           **{move.part: True}).wait(), "h2d")
        else:   # the actor's own forward comes first and waits for it
            self.copies.stream_back(record, move.part, by_kernel=move.by_kernel)

    # ---------------------------------------------------------------- training phase

    def log_probs(self, batch: RolloutBatch) -> tuple[dict, SwitchRecord]:
        """{"old": the sampling policy's log-probs, "ref": the reference's} (None where not
        needed), and the record of the ref's moves (on the card only for its forward).

        With one update per step "old" is None: the policy has not moved, so the update's own
        (detached) forward gives them and a pass is saved."""
        record = SwitchRecord()
        ref_back, self.copies.ref_back = self.copies.ref_back, None
        old = None
        if self.cfg.actor.updates_per_step > 1:
            old = self.clock.compute("old_logprobs", lambda: self.actor.log_probs(
                batch, with_entropy=False, hooks=self._copies_beside(record, self.actor)
            )[0])
        ref = None
        if self.ref is not None:
            back, down = self.order.get("ref_h2d"), self.order.get("ref_d2h")
            if back is not None and back.phase == "ref_forward":
                ref_back = self.copies.start_ref_back()
            if ref_back is not None:
                moved = ref_back.wait()["params"]
                record.add("ref_h2d", moved["seconds"], moved["bytes"])
            ref = self.clock.compute("ref_forward", lambda: self.ref.log_probs(
                batch, with_entropy=False, hooks=self._copies_beside(record, self.ref)
            )[0])
            if down is not None:   # dropped: the ref never changes, its host copy is the truth
                moved = self.ref.to("host", params=True,
                                    copy=down.how != "drop").wait()["params"]
                record.add("ref_d2h", moved["seconds"], moved["bytes"])
        elif self.actor.lora is not None and self.cfg.actor.kl_coef > 0:   # adapters off
            ref = self.clock.compute("ref_forward", lambda: self.actor.base_log_probs(
                batch, hooks=self._copies_beside(record, self.actor)))
        self.probe("after ref forward")   # with no ref too: every step has the same probes
        return {"old": old, "ref": ref}, record

    def _copies_beside(self, record: SwitchRecord, model, *, last: bool = False,
                       backward: bool = False) -> _PassHooks:
        """A pass's hooks (model.PassHooks): the copies back still due are queued beside it.

        Before any forward, its GEMM shapes new to the process are launched (memory.warm_gemms:
        trainer/gemm_warmup.py says why). The copies are queued once its first micro-batches are
        (PassHooks.first_launched): queueing allocates their storages, which waits for the
        driver to clear the memory the engine's pool just freed, and the device computes
        meanwhile. Both are the clock's queueing, not the pass's work."""
        def inputs_ready(micro_batches: list) -> None:
            if self.copies.due_back and self.cfg.memory.warm_gemms:
                self.clock.warm_up(lambda: model.warm_gemms(micro_batches, backward=backward))

        def first_launched() -> None:
            if self.copies.due_back:
                self.clock.queueing(lambda: self.copies.stream_due_back(record, last=last))
        return _PassHooks(inputs_ready, first_launched)

    def update(self, batch: RolloutBatch) -> tuple[dict[str, float], SwitchRecord]:
        """The GRPO update; the optimizer's state comes back right before it in the
        sequential order. Streamed, what is left of its copy is waited for first (the
        update's inputs would upload behind it), as the compute's wait for a copy; with no
        pass before (or no room beside it), it is queued once the update's first
        micro-batch is and lands inside it, before the optimizer step."""
        record = SwitchRecord()
        hooks = None
        back = self.order.get("optimizer_h2d")
        if self.cfg.memory.overlap:   # the streamed order, or LoRA's streamed
            hooks = self._copies_beside(record, self.actor, last=True, backward=True)
        elif back is not None:
            record.add_moves(self.actor.to("device", optimizer=True).wait(), "h2d")

        def run() -> dict[str, float]:
            due = self.copies.due_back
            if due[:1] == ["params"]:   # had no room before: the update needs them
                self.copies.stream_back(record, due.pop(0))
            if self.copies.coming_back("optimizer"):
                self.actor.require_on_device("optimizer")
            return self.actor.update(batch, hooks=hooks, backward_done=(
                self._flush_activations if self.streams_to_host else None))

        metrics = self.clock.compute("update", run)
        self.copies.land_coming_back(record)
        self.probe("after update")
        return metrics, record

    def _flush_activations(self) -> None:
        """Streamed, after the last backward: the activations' memory back to the driver (the
        host waits for the device then anyway), which clears what it gets back before it can
        be mapped again; the KV wake comes a few tenths later. The flush waits for every
        stream, so the optimizer's copy is waited for first, as the compute's wait."""
        self.actor.require_on_device("optimizer")
        aggressive_empty_cache()

    # ---------------------------------------------------------------- the switch back

    def _wake_weights(self, record: SwitchRecord) -> None:
        """Wake the engine's weights while the optimizer copy runs; if the card is too full
        for that, wait for the copy to free the optimizer's memory and try once more."""
        try:
            self.engine.wake_up(["weights"])
        except HandoffError:
            if not self.cfg.memory.optimizer_offload:
                raise
            self.copies.land(record, wait=True)
            self.clock.flush()
            self.engine.wake_up(["weights"])

    def _backed_up_bytes(self) -> int:
        """What the engine's sleep copies to the host and its wake back: the weights of a LoRA
        base of the trainer's own (level 1); nothing at level 2 or on a shared base."""
        if self.actor.lora is None or self.lora_shared:
            return 0
        return self.engine.pool.tracked_bytes("weights")

    @functools.cached_property
    def _kept_param_bytes(self) -> int:
        """This rank's engine shard of every param (all of it at TP 1): the plan's count of
        the sync. The layout is the run's, so counted once, not per tensor in the sync."""
        return kept_bytes(self.actor.full_shapes(), self.engine.dtype, self.engine.weight_shard)

    def _synced_bytes(self, record: SwitchRecord) -> int:
        """What the sync wrote into this rank's engine: the adapters (each rank all of them),
        or its shard of the full params that every rank streams whole."""
        if self.actor.lora is not None:
            return record.sync.bytes
        return self._kept_param_bytes

    def _sync_weights(self, record: SwitchRecord) -> None:
        """Full-parameter: the engine's weights mapped, then every param sent. LoRA: the
        adapters only, in place (switch/lora.py), after the wake restored a base of the
        trainer's own from the host (a shared one never left)."""
        if not self.lora_shared:
            t0 = time.perf_counter()
            self._wake_weights(record)
            record.weights_wake_seconds = time.perf_counter() - t0
        if self.actor.lora is not None:
            record.sync = sync_lora(self.actor, self.engine)
            return
        record.sync = sync_weights(
            self.actor.full_params(self.engine.dtype), self.engine.load_weights,
            bucket_bytes=self.cfg.sync.bucket_mb << 20, device=self.device,
            readback=self.engine.export_weight if self.cfg.sync.verify else None,
            select=self.engine.weight_shard)

    def _hand_back_in_turn(self, record: SwitchRecord) -> None:
        """The copies to the host waited for one after the other, before the KV pool maps."""
        if self.order.get("optimizer_d2h"):
            # The optimizer's memory goes back to the driver as soon as its copy ends,
            # while the params' copy (on the same D2H stream, so no later) runs: the
            # driver clears freed pages before it maps them again.
            self.copies.land(record, wait=True)
            self.clock.flush()
        if self.order.get("params_d2h"):
            self.copies.start_to_host("params")
            self.copies.land(record, wait=True)
        self.clock.flush()

    def _wake_kv_cache(self) -> None:
        """Map the KV pool. Streamed, an elastic pool maps what is free beside the copies
        still running; if not even its least fits there, they land first (said once)."""
        try:
            self.engine.wake_up(["kv_cache"])
        except HandoffError as e:
            if not self.copies.pending:
                raise
            self._say_once("kv wake", f"memory.overlap: the KV pool could not map beside the "
                           f"copies to the host ({e}): they are waited for first (the "
                           "sequential order)")
            self.settle()
            self.engine.wake_up(["kv_cache"])

    def to_rollout(self) -> SwitchRecord:
        """Training -> generation, the order's `to_rollout` moves (and `generation`'s queued)."""
        record = SwitchRecord()
        if "params" in self.copies.due_back:   # a step without training: the sync reads them
            self.copies.stream_back(record, "params", by_kernel=True)
        self.copies.due_back.clear()     # the optimizer, never needed, stays on the host
        self.copies.land_coming_back(record)
        if self.streams_to_host or not self.cfg.memory.optimizer_offload:
            # Before any copy is queued, emptying waits only for the update's kernels;
            # streamed, the training phase's cached blocks so go back to the driver for the
            # KV wake to map.
            self.clock.flush()
        early = self.order.get("optimizer_d2h")
        if early is not None and early.phase == "to_rollout":
            self.copies.start_to_host("optimizer")
            # Emptying the cache now would wait for the optimizer copy (and free none of its
            # memory: that comes when the copy is waited on): the weights wake tries without
            # it, and _wake_weights waits, empties and retries if it must.
            gc.collect()
        self.probe("before resume weights")
        with expandable_segments(False):
            self._timed(record, "engine_weights_sync", lambda: self._sync_weights(record),
                        nbytes=lambda: self._synced_bytes(record) + self._backed_up_bytes())
            self.probe("after update_weights")
            if self.streams_to_host:
                # Generation starts before the copies: they start under it and land between
                # its steps.
                self.copies.queue_to_host([m.part for m in self.order.at("generation")])
            else:
                self._hand_back_in_turn(record)
            self.probe("after params offload")
            # Mapped, not copied: the ledger counts the pool's bytes for this action too.
            self._timed(record, "kv_cache_wake", self._wake_kv_cache,
                        nbytes=lambda: self.kv_pool_bytes)
        self.engine.reset_prefix_cache()
        self.probe("after resume kv_cache")
        return record
