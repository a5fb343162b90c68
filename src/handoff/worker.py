"""The hybrid worker: actor, reference and rollout engine in one process, and the switch.

    worker = HybridWorker(cfg)
    outs = worker.generate(prompts, params)          # engine awake, trainer state on the host
    worker.to_train()                                # engine.sleep(2), actor params back
    batch.old_logprobs = worker.old_log_probs(batch)
    batch.ref_logprobs = worker.ref_log_probs(batch) # ref onload -> forward -> offload
    metrics = worker.update(batch)                   # optimizer onload -> update
    worker.to_rollout()                              # the brief's switch order, below

`to_rollout()` runs the order of BRIEF.md ("The switch order"), which sets the peak:
optimizer D2H (started first, overlapped with what follows), empty the caching allocator,
expandable_segments off, wake the engine's weights region, stream the actor's full params
into it, actor params D2H, wait for the optimizer copy, empty cache, wake the KV pool (the
largest, so last), expandable_segments back on, reset the prefix cache. Every point is a
meter probe under the brief's names, and every action is timed under the ledger's name
(handoff.plan.ledger.SWITCH_ACTIONS) with the bytes it moved, so a run prints planned vs
measured side by side. Offloads the config turns off are skipped and recorded as 0 bytes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from handoff.config import Config
from handoff.memory.meter import MemoryMeter
from handoff.memory.regions import RegionPool, aggressive_empty_cache, expandable_segments
from handoff.memory.staging import PinnedArena
from handoff.rollout.engine import Engine
from handoff.sync.weights import SyncStats, sync_weights
from handoff.train.actor import build_actor, build_reference
from handoff.train.batch import RolloutBatch
from handoff.train.dist import resolve_device

# The probe names of one step, in order (the brief's "before resume weights" etc.).
PROBES_TO_TRAIN = ("after generate", "after engine sleep", "after params onload")
PROBES_TO_ROLLOUT = ("after update", "before resume weights", "after update_weights",
                     "after params offload", "after resume kv_cache")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HybridWorker:
    """One device's actor + reference + engine, handing the memory over twice per step."""

    def __init__(self, cfg: Config, *, device: str | torch.device | None = None):
        self.cfg = cfg
        self.device = resolve_device(device or cfg.run.device)
        self.arena = PinnedArena(pin=self.device.type == "cuda")
        self.pool = RegionPool(self.device, wake_margin_bytes=cfg.memory.wake_margin_mb << 20)
        self.meter = MemoryMeter(self.device, pool=self.pool, arena=self.arena)
        self.pool.meter = self.meter
        self.actor = build_actor(cfg, device=self.device, arena=self.arena)
        self.ref = build_reference(cfg, device=self.device, arena=self.arena)
        self.engine = Engine(cfg.model.path, cfg.rollout, device=self.device,
                             dtype=cfg.model.dtype, pool=self.pool)
        self.engine_dtype = self.engine.dtype
        self.actions: dict[str, dict[str, float]] = {}
        self.last_sync: SyncStats | None = None
        self.step = 0

    def start(self, *, resumed: bool) -> None:
        """Enter the rollout phase: the trainer's state goes to the host, the engine is ready.

        The engine loaded the checkpoint's weights itself; after a resume the actor holds
        newer ones, so they go through the normal switch (sleep, wake, sync). Its probes
        carry step -1, before the first step.
        """
        self.step = -1
        if self.ref is not None and self.cfg.memory.ref_offload:
            self.ref.to("host", params=True).wait()
        if resumed:
            self.engine.sleep(2)
            self.to_rollout()
            self.actions = {}
        else:
            self._move_actor("host", params=self.cfg.memory.param_offload,
                             optimizer=self.cfg.memory.optimizer_offload, record=False)
        aggressive_empty_cache()
        self.probe("start")

    # ---------------------------------------------------------------- recording

    def _record(self, action: str, seconds: float, nbytes: int) -> None:
        entry = self.actions.setdefault(action, {"seconds": 0.0, "bytes": 0})
        entry["seconds"] += seconds
        entry["bytes"] += nbytes

    @contextmanager
    def _timed(self, action: str, nbytes: int = 0):
        _sync(self.device)
        t0 = time.perf_counter()
        yield
        _sync(self.device)
        self._record(action, time.perf_counter() - t0, nbytes)

    def probe(self, name: str) -> dict:
        return self.meter.probe(name, step=self.step)

    def _move_actor(self, where: str, *, record: bool = True, **parts: bool) -> dict:
        wanted = {k: v for k, v in parts.items() if v}
        if not wanted:
            return {}
        done = self.actor.to(where, **wanted).wait()
        if record:
            suffix = "d2h" if where == "host" else "h2d"
            for part, r in done.items():
                self._record(f"{part}_{suffix}", r["seconds"], int(r["bytes"]))
        return done

    def begin_step(self, step: int) -> None:
        self.step = step
        self.actions = {}

    # ---------------------------------------------------------------- rollout phase

    def generate(self, prompts: list[list[int]], params, *, progress: bool = False):
        outs = self.engine.generate(prompts, params, progress=progress)
        self.probe("after generate")
        return outs

    def to_train(self) -> None:
        """Engine sleep(2) (weights and KV discarded), then the actor's params come back."""
        with self._timed("engine_sleep"):
            self.engine.sleep(2)
        aggressive_empty_cache()
        self.probe("after engine sleep")
        self._move_actor("device", params=self.cfg.memory.param_offload)
        self.probe("after params onload")

    # ---------------------------------------------------------------- training phase

    def old_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        logp, _ = self.actor.log_probs(batch, with_entropy=False)
        return logp

    def ref_log_probs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Reference log-probs, loading the ref model only for its forward."""
        if self.ref is None:
            return None
        offload = self.cfg.memory.ref_offload
        if offload:
            r = self.ref.to("device", params=True).wait()["params"]
            self._record("ref_h2d", r["seconds"], int(r["bytes"]))
        logp, _ = self.ref.log_probs(batch, with_entropy=False)
        if offload:
            r = self.ref.to("host", params=True).wait()["params"]
            self._record("ref_d2h", r["seconds"], int(r["bytes"]))
        return logp

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Optimizer state back right before the update (the brief's step 8), then update."""
        self._move_actor("device", optimizer=self.cfg.memory.optimizer_offload)
        metrics = self.actor.update(batch)
        self.probe("after update")
        return metrics

    # ---------------------------------------------------------------- the switch back

    def to_rollout(self) -> SyncStats:
        """Training -> generation in the brief's order (see the module docstring)."""
        mem = self.cfg.memory
        opt_move = self.actor.to("host", optimizer=True) if mem.optimizer_offload else None
        aggressive_empty_cache()
        self.probe("before resume weights")
        with expandable_segments(False):
            with self._timed("engine_weights_sync"):
                self.engine.wake_up(["weights"])
                self.last_sync = sync_weights(
                    self.actor.full_params(self.engine_dtype), self.engine.load_weights,
                    bucket_bytes=self.cfg.sync.bucket_mb << 20, device=self.device,
                    readback=self.engine.export_weight if self.cfg.sync.verify else None)
            self.actions["engine_weights_sync"]["bytes"] += self.last_sync.bytes
            self.probe("after update_weights")
            self._move_actor("host", params=mem.param_offload)
            if opt_move is not None:
                r = opt_move.wait()["optimizer"]
                self._record("optimizer_d2h", r["seconds"], int(r["bytes"]))
            aggressive_empty_cache()
            self.probe("after params offload")
            # Mapped, not copied: the ledger counts the pool's bytes for this action too.
            with self._timed("kv_cache_wake", self.pool.region_bytes("kv_cache")):
                self.engine.wake_up(["kv_cache"])
        self.engine.reset_prefix_cache()
        self.probe("after resume kv_cache")
        return self.last_sync
