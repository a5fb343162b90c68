"""The switch: one device's actor, reference and engine, and the moves that hand the memory
from one to the other. Every move returns a SwitchRecord of what it did.

    worker, rates = start_worker(cfg)                 # handoff.startup
    outs = worker.generate(prompts, params)           # engine awake, trainer state on the host
    record = worker.to_train()                        # engine.sleep(2), actor params back
    logprobs, moves = worker.log_probs(batch)         # old (if needed) and ref log-probs
    metrics, opt = worker.update(batch)               # optimizer back, the GRPO update
    record = worker.to_rollout()                      # the switch back (order below)

The order of both switches, and why it is that order, is in docs/ARCHITECTURE.md ("The
switch"). Every point is a meter probe under the source's names, and every action is timed
under the ledger's name (handoff.plan.ledger.SWITCH_ACTIONS) with the bytes it moved, so a
run prints planned vs measured side by side. Offloads the config turns off are skipped and
recorded as 0 bytes.

Under torchrun each rank runs one worker: the trainer's FSDP2 mesh spans every rank, and
the engines of parallel.tp consecutive ranks form one tensor-parallel engine (each rank
sleeps, wakes and loads its own shard; every rank sends its engine all full params).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from handoff.config import Config
from handoff.dist import wait_for_compute
from handoff.errors import HandoffError
from handoff.memory.allocator import aggressive_empty_cache, expandable_segments
from handoff.memory.meter import MemoryMeter
from handoff.memory.regions import RegionPool
from handoff.plan.ledger import SWITCH_ACTIONS
from handoff.rollout.engine import Engine
from handoff.sync.weights import SyncStats, sync_weights
from handoff.train.actor import Actor
from handoff.train.batch import RolloutBatch
from handoff.train.model import ShardedModel

T = TypeVar("T")

# The probe names of one step, in order (the source's "before resume weights" etc.).
PROBES_TO_TRAIN = ("after generate", "after engine sleep", "after params onload")
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
        self.probe("start")

    def probe(self, name: str) -> dict:
        return self.meter.probe(name, step=self.step)

    def begin_step(self, step: int) -> None:
        self.step = step

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

    def load_trainer_state(self, load: Callable[[Actor], T]) -> T:
        """Resume: `load(actor)` with the trainer's state on the card, then the normal switch.

        The engine sleeps meanwhile (its weights are stale anyway: it loaded the initial
        checkpoint), and `to_rollout` pushes the resumed weights into it.
        """
        mem = self.cfg.memory
        self.engine.sleep(2)
        aggressive_empty_cache()
        if mem.param_offload or mem.optimizer_offload:
            self.actor.to("device", params=mem.param_offload,
                          optimizer=mem.optimizer_offload).wait()
        result = load(self.actor)
        self.to_rollout()
        return result

    # ---------------------------------------------------------------- rollout phase

    def generate(self, prompts: list[list[int]], params, *, progress: bool = False):
        outs = self.engine.generate(prompts, params, progress=progress)
        self.probe("after generate")
        return outs

    def to_train(self) -> SwitchRecord:
        """Engine sleep(2) (weights and KV discarded), then the actor's params come back, by
        kernel: right after a large sleep the copy engines run at half rate (docs/PERF.md)."""
        record = SwitchRecord()
        self._timed(record, "engine_sleep", lambda: self.engine.sleep(2))
        aggressive_empty_cache()
        self.probe("after engine sleep")
        if self.cfg.memory.param_offload:
            record.add_moves(self.actor.to("device", params=True, by_kernel=True).wait(), "h2d")
        self.probe("after params onload")
        return record

    # ---------------------------------------------------------------- training phase

    def log_probs(self, batch: RolloutBatch) -> tuple[dict, SwitchRecord]:
        """{"old": the sampling policy's log-probs, "ref": the reference's} (None where not
        needed), and the record of the ref's moves (loaded only for its forward).

        With one update per step "old" is None: the policy has not moved, so the update's own
        (detached) forward gives them and a pass is saved."""
        record = SwitchRecord()
        old = None
        if self.cfg.actor.updates_per_step > 1:
            old, _ = self.actor.log_probs(batch, with_entropy=False)
        ref = None
        if self.ref is not None:
            offload = self.cfg.memory.ref_offload
            if offload:
                moved = self.ref.to("device", params=True, by_kernel=True).wait()["params"]
                record.add("ref_h2d", moved["seconds"], moved["bytes"])
            ref, _ = self.ref.log_probs(batch, with_entropy=False)
            if offload:
                moved = self.ref.to("host", params=True).wait()["params"]
                record.add("ref_d2h", moved["seconds"], moved["bytes"])
        return {"old": old, "ref": ref}, record

    def update(self, batch: RolloutBatch) -> tuple[dict[str, float], SwitchRecord]:
        """Optimizer state back right before the update, then the update."""
        record = SwitchRecord()
        if self.cfg.memory.optimizer_offload:
            record.add_moves(self.actor.to("device", optimizer=True).wait(), "h2d")
        metrics = self.actor.update(batch)
        self.probe("after update")
        return metrics, record

    # ---------------------------------------------------------------- the switch back

    def _wake_weights(self, opt_move) -> None:
        """Wake the engine's weights while the optimizer copy runs; if the card is too full
        for that, wait for the copy to free the optimizer's memory and try once more."""
        try:
            self.engine.wake_up(["weights"])
        except HandoffError:
            if opt_move is None:
                raise
            for transfer in opt_move.transfers.values():
                if transfer is not None:
                    transfer.wait()
            aggressive_empty_cache()
            self.engine.wake_up(["weights"])

    def _sync_weights(self, record: SwitchRecord, opt_move) -> None:
        t0 = time.perf_counter()
        self._wake_weights(opt_move)
        record.weights_wake_seconds = time.perf_counter() - t0
        record.sync = sync_weights(
            self.actor.full_params(self.engine.dtype), self.engine.load_weights,
            bucket_bytes=self.cfg.sync.bucket_mb << 20, device=self.device,
            readback=self.engine.export_weight if self.cfg.sync.verify else None,
            select=self.engine.weight_shard)

    def to_rollout(self) -> SwitchRecord:
        """Training -> generation in the switch order of docs/ARCHITECTURE.md."""
        mem = self.cfg.memory
        record = SwitchRecord()
        opt_move = self.actor.to("host", optimizer=True) if mem.optimizer_offload else None
        if opt_move is None:
            aggressive_empty_cache()
        else:
            # Emptying the cache now would wait for the optimizer copy (and free none of its
            # memory: that comes when the copy is waited on): the weights wake tries without
            # it, and _wake_weights waits, empties and retries if the card is too full.
            gc.collect()
        self.probe("before resume weights")
        with expandable_segments(False):
            self._timed(record, "engine_weights_sync", lambda: self._sync_weights(record, opt_move),
                        nbytes=lambda: record.sync.bytes)
            self.probe("after update_weights")
            if opt_move is not None:
                # The optimizer's memory goes back to the driver as soon as its copy ends,
                # while the params' copy (on the same D2H stream, so no later) runs: the
                # driver clears freed pages before it maps them again.
                record.add_moves(opt_move.wait(), "d2h")
                aggressive_empty_cache()
            if mem.param_offload:
                record.add_moves(self.actor.to("host", params=True).wait(), "d2h")
            aggressive_empty_cache()
            self.probe("after params offload")
            # Mapped, not copied: the ledger counts the pool's bytes for this action too.
            self._timed(record, "kv_cache_wake", lambda: self.engine.wake_up(["kv_cache"]),
                        nbytes=lambda: self.pool.region_bytes("kv_cache"))
        self.engine.reset_prefix_cache()
        self.probe("after resume kv_cache")
        return record
