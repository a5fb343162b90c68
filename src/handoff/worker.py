"""The hybrid worker: actor, reference and rollout engine in one process, and the switch.

    worker = HybridWorker(cfg)
    outs = worker.generate(prompts, params)          # engine awake, trainer state on the host
    worker.to_train()                                # engine.sleep(2), actor params back
    batch.old_logprobs = worker.old_log_probs(batch)
    batch.ref_logprobs = worker.ref_log_probs(batch) # ref onload -> forward -> offload
    metrics = worker.update(batch)                   # optimizer onload -> update
    worker.to_rollout()                              # the brief's switch order, below

`to_rollout()` runs the order of BRIEF.md ("The switch order"), which sets the peak:
optimizer D2H (started first, overlapped with what follows), empty the caching allocator
(skipped while that copy runs: emptying would wait for it), expandable_segments off, wake
the engine's weights region, stream the actor's full params into it, wait for the
optimizer copy and empty the cache, actor params D2H, empty cache, wake the KV pool (the
largest, so last), expandable_segments back on, reset the prefix cache. Every point is a
meter probe under the brief's names, and every action is timed under the ledger's name
(handoff.plan.ledger.SWITCH_ACTIONS) with the bytes it moved, so a run prints planned vs
measured side by side. Offloads the config turns off are skipped and recorded as 0 bytes.

Under torchrun each rank runs one worker: the trainer's FSDP2 mesh spans every rank, and
the engines of parallel.tp consecutive ranks form one tensor-parallel engine (each rank
sleeps, wakes and loads its own shard; every rank sends its engine all full params).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch

from handoff.config import Config
from handoff.errors import HandoffError
from handoff.memory.calibrate import measure_remap_rates, measure_sync_copy_bps
from handoff.memory.meter import MemoryMeter, host_memory
from handoff.memory.regions import RegionPool, aggressive_empty_cache, expandable_segments
from handoff.memory.staging import PinnedArena
from handoff.plan.hardware import hardware_profile
from handoff.plan.kvpool import engine_weight_bytes, kv_bytes_per_token_per_card
from handoff.plan.ledger import SWITCH_ACTIONS, Dtypes, shard_size, trainer_bytes
from handoff.plan.shapes import load_shape
from handoff.rollout.engine import CPU_DEFAULT_KV_BYTES, Engine
from handoff.sync.weights import SyncStats, sync_weights
from handoff.train.actor import Actor, build_actor, build_reference
from handoff.train.batch import RolloutBatch
from handoff.rollout.parallel import check_world_size, init_tp_group
from handoff.train.dist import init_process_group, resolve_device

T = TypeVar("T")

# The probe names of one step, in order (the brief's "before resume weights" etc.).
PROBES_TO_TRAIN = ("after generate", "after engine sleep", "after params onload")
PROBES_TO_ROLLOUT = ("after update", "before resume weights", "after update_weights",
                     "after params offload", "after resume kv_cache")


def _bytes_to_calibrate(cfg: Config, pool: RegionPool) -> tuple[int, int, list]:
    """(KV pool, weights) bytes the engine is about to allocate (the pool sized as
    Engine._num_blocks does, with the planner's activation peak and graph pool for the ones
    it profiles), each at most what is free now less the wake margin and 1 GiB of slack;
    and [(bytes, seconds before the KV wake)] that to_rollout hands back to the driver: the
    optimizer once its copy ends (the params copy still to go), then the params and the
    sync's two buckets right before the wake."""
    shape = load_shape(cfg.model.path)
    dtypes = Dtypes.for_model(cfg.model.dtype, cfg.rollout.kv_dtype)
    ro, tp = cfg.rollout, cfg.parallel.tp
    hw = hardware_profile(cfg.hardware.name, cfg.hardware)
    weights = engine_weight_bytes(shape, tp, dtypes.engine_bytes)
    block = int(kv_bytes_per_token_per_card(shape, tp, dtypes.kv_bytes)) * ro.block_size
    needed = -(-ro.max_model_len // ro.block_size) + 1
    if pool.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(pool.device)
    else:
        free, total = host_memory()[1] or 1 << 62, 0
    if ro.num_blocks is not None:
        want = ro.num_blocks * block
    elif pool.device.type == "cuda":
        want = (ro.gpu_memory_utilization * total - hw.activation_peak_bytes - hw.graph_pool_bytes
                - weights)
    else:
        want = max(needed, min(ro.max_num_seqs * (needed - 1) + 1,
                               CPU_DEFAULT_KV_BYTES // block)) * block
    room = free - pool.wake_margin_bytes - (1 << 30)
    weights = int(max(min(weights, room), 1))
    owners = trainer_bytes(shape, shard_size(cfg.parallel), dtypes, ref=False)
    params = owners["params"] if cfg.memory.param_offload else 0
    late = min(params + 2 * (cfg.sync.bucket_mb << 20), room - weights)
    early = owners["optimizer"] if cfg.memory.optimizer_offload else 0
    early = min(early, room - weights - late)
    freed = [(int(late), 0.0)] + ([(int(early), params / hw.pinned_pcie_bps)] if early > 0 else [])
    return int(max(min(want, room), block)), weights, freed


def _sync(device: torch.device) -> None:
    """Wait for the compute stream only: arena copies on their own streams run on."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class HybridWorker:
    """One device's actor + reference + engine, handing the memory over twice per step."""

    def __init__(self, cfg: Config, *, device: str | torch.device | None = None):
        self.cfg = cfg
        self.device = resolve_device(device or cfg.run.device)
        init_process_group(self.device)   # torchrun's ranks, or a 1-process group
        check_world_size(cfg.parallel.gpus)
        self.arena = PinnedArena(pin=self.device.type == "cuda")
        self.pool = RegionPool(self.device, wake_margin_bytes=cfg.memory.wake_margin_mb << 20)
        self.meter = MemoryMeter(self.device, pool=self.pool, arena=self.arena)
        self.pool.meter = self.meter
        self.actions: dict[str, dict[str, float]] = {}
        self.last_sync: SyncStats | None = None
        self.last_wake_seconds = 0.0   # the weights region's map, inside engine_weights_sync
        self.step = -1  # probes before the first step carry step -1
        self.actor = build_actor(cfg, device=self.device, arena=self.arena)
        self.ref = build_reference(cfg, device=self.device, arena=self.arena)
        # Rates the ledger prices a run with, measured before the engine takes the card
        # (RunReport adds the links'). First the sync's copies, over the actor's own
        # tensors while they are still on the card.
        self.start_rates = measure_sync_copy_bps(self.device, self.actor.full_params,
                                                 bucket_bytes=cfg.sync.bucket_mb << 20)
        # The trainer's state leaves the card before the engine sizes its KV pool from
        # what is free: the run starts in the rollout phase.
        if self.ref is not None and cfg.memory.ref_offload:
            self.ref.to("host", params=True).wait()
        self._move_actor("host", params=cfg.memory.param_offload,
                         optimizer=cfg.memory.optimizer_offload, record=False)
        aggressive_empty_cache()
        # The ledger's map/unmap rates, measured on the memory the engine is about to take
        # at the two sizes a step maps (mapping time is not linear in size): the KV pool and
        # the weights. The regions stay asleep for good (no physical memory behind them;
        # torch_memory_saver keeps their addresses until the process ends).
        # The KV map is measured as the switch does it: weights mapped, the trainer's
        # offloaded state handed back when to_rollout hands it back, the pool's own pages
        # released seconds before (a step trains in between; a 0.6 s settle measured the
        # 4B pool's map 3x slower than its steps did). Four pairs: one pair's times vary by
        # a quarter from step to step (the 4B engine's sleeps took 57-105 ms on one card).
        kv_bytes, weight_bytes, freed = _bytes_to_calibrate(cfg, self.pool)
        on_cuda = self.device.type == "cuda"
        self.start_rates.update(measure_remap_rates(
            self.device, kv_bytes, pool=self.pool, repeats=4, held_during_wake=weight_bytes,
            freed_before_wake=freed, settle_s=2.0 if on_cuda else 0.0))
        weights = measure_remap_rates(self.device, weight_bytes, pool=self.pool,
                                      tag="calibrate_weights")
        self.start_rates.update(weights_map_bps=weights["map_bps"],
                                weights_remap_bytes=weights["remap_bytes"])
        self.engine = Engine(cfg.model.path, cfg.rollout, device=self.device,
                             dtype=cfg.model.dtype, pool=self.pool,
                             tp=init_tp_group(cfg.parallel.tp))
        self.engine_dtype = self.engine.dtype
        self.probe("start")

    def load_trainer_state(self, load: Callable[[Actor], T]) -> T:
        """Resume: `load(actor)` with the trainer's state on the card, then the normal switch.

        The engine sleeps meanwhile (its weights are stale anyway: it loaded the initial
        checkpoint), and `to_rollout` pushes the resumed weights into it.
        """
        self.engine.sleep(2)
        aggressive_empty_cache()
        self._move_actor("device", params=self.cfg.memory.param_offload,
                         optimizer=self.cfg.memory.optimizer_offload, record=False)
        result = load(self.actor)
        self.to_rollout()
        self.actions = {}
        return result

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

    def _move_actor(self, where: str, *, record: bool = True, by_kernel: bool = False,
                    **parts: bool) -> dict:
        wanted = {k: v for k, v in parts.items() if v}
        if not wanted:
            return {}
        done = self.actor.to(where, by_kernel=by_kernel, **wanted).wait()
        if record:
            suffix = "d2h" if where == "host" else "h2d"
            for part, r in done.items():
                self._record(f"{part}_{suffix}", r["seconds"], int(r["bytes"]))
        return done

    def begin_step(self, step: int) -> None:
        self.step = step
        # Every ledger action starts at 0 s / 0 B, so one the config turns off (an offload,
        # or the ref with kl_coef=0) still has its row: the step's metrics keep one shape.
        self.actions = {a: {"seconds": 0.0, "bytes": 0} for a in SWITCH_ACTIONS}

    # ---------------------------------------------------------------- rollout phase

    def generate(self, prompts: list[list[int]], params, *, progress: bool = False):
        outs = self.engine.generate(prompts, params, progress=progress)
        self.probe("after generate")
        return outs

    def to_train(self) -> None:
        """Engine sleep(2) (weights and KV discarded), then the actor's params come back.

        For about a second after the sleep the copy engines are busy (likely the driver
        clearing the released pages) and an H2D on them runs at half the link's rate
        (scripts/h2d_after_unmap.py): the params and the ref come back by kernel
        (PinnedArena.onload(by_kernel=True))."""
        with self._timed("engine_sleep"):
            self.engine.sleep(2)
        aggressive_empty_cache()
        self.probe("after engine sleep")
        self._move_actor("device", params=self.cfg.memory.param_offload, by_kernel=True)
        self.probe("after params onload")

    # ---------------------------------------------------------------- training phase

    def old_log_probs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """The sampling policy's log-probs, or None with one update per step: the policy has
        not moved, so the update's own (detached) forward gives them and a pass is saved."""
        if self.cfg.actor.updates_per_step == 1:
            return None
        logp, _ = self.actor.log_probs(batch, with_entropy=False)
        return logp

    def ref_log_probs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Reference log-probs, loading the ref model only for its forward."""
        if self.ref is None:
            return None
        offload = self.cfg.memory.ref_offload
        if offload:
            r = self.ref.to("device", params=True, by_kernel=True).wait()["params"]
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

    def to_rollout(self) -> SyncStats:
        """Training -> generation in the brief's order (see the module docstring)."""
        mem = self.cfg.memory
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
            with self._timed("engine_weights_sync"):
                t0 = time.perf_counter()
                self._wake_weights(opt_move)
                self.last_wake_seconds = time.perf_counter() - t0
                self.last_sync = sync_weights(
                    self.actor.full_params(self.engine_dtype), self.engine.load_weights,
                    bucket_bytes=self.cfg.sync.bucket_mb << 20, device=self.device,
                    readback=self.engine.export_weight if self.cfg.sync.verify else None,
                    select=self.engine.weight_shard)
            self.actions["engine_weights_sync"]["bytes"] += self.last_sync.bytes
            self.probe("after update_weights")
            if opt_move is not None:
                # The optimizer's memory goes back to the driver as soon as its copy ends,
                # while the params copy (on the same D2H stream, so no later) runs: the
                # driver clears freed pages before it maps them again, and the KV pool next
                # maps most of the card.
                r = opt_move.wait()["optimizer"]
                self._record("optimizer_d2h", r["seconds"], int(r["bytes"]))
                aggressive_empty_cache()
            self._move_actor("host", params=mem.param_offload)
            aggressive_empty_cache()
            self.probe("after params offload")
            # Mapped, not copied: the ledger counts the pool's bytes for this action too.
            with self._timed("kv_cache_wake", self.pool.region_bytes("kv_cache")):
                self.engine.wake_up(["kv_cache"])
        self.engine.reset_prefix_cache()
        self.probe("after resume kv_cache")
        return self.last_sync
