"""Every rate a run's ledger is priced with, measured once on the run's own card.

    rates = calibrate(cfg, plan, actor, pool)   # trainer state where the rollout phase keeps it,
                                          # the engine not built yet
    hw = rates.profile(hardware_profile("h200"))

What is measured, and why at this size and in this state:
* the links: pinned D2H and H2D on the copy engines, H2D by kernel (handoff.memory.host_copy,
  as to_train copies right after the engine's sleep), a device-to-device copy;
* map and unmap of a region the size of the KV pool the engine is about to take (mapping is
  not linear in size), in the state the switch maps it: the weights mapped, the trainer's
  offloaded state handed back to the driver when to_rollout hands it back, the pool's own
  pages released seconds before; through the mechanism the pool uses (an elastic pool is
  one driver allocation per layer's K or V: a 14B run's sleep took 1.48x what one
  allocation's unmap priced, docs/PERF.md); and the map of a region the weights' size;
* the weight sync's copies: the real `sync_weights` over the actor's own tensors (a kernel
  per tensor into the bucket, batched copies out of it), slower per byte than one large copy;
* the sync's host work per tensor, timed while a D2H of the optimizer's size is queued (the
  sync runs while the optimizer's offload does).
The measurements behind these choices are in docs/PERF.md.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from handoff.config import Config
from handoff.dist import wait_for_device
from handoff.errors import HandoffError
from handoff.reading import expect, read_json
from handoff.memory.allocator import aggressive_empty_cache, host_memory
from handoff.memory.elastic import ElasticArena
from handoff.memory.host_copy import copy_from_host
from handoff.memory.regions import RegionPool
from handoff.plan.hardware import HardwareProfile
from handoff.plan.kvpool import engine_weight_bytes, kv_bytes_per_token_per_card
from handoff.plan.ledger import trainer_bytes
from handoff.plan.lora import BaseCopies, adapter_params, adapter_state_bytes
from handoff.plan.order import SwitchOrder
from handoff.rollout.kv_sizing import kv_pool_blocks
from handoff.rollout.weight_copy import copy_in_batches
from handoff.runplan import RunPlan
from handoff.sync.adapters import sync_adapters
from handoff.sync.weights import WeightIter, sync_weights

# rates key -> the hardware profile field it replaces in the ledger
_PROFILE_FIELDS = {"d2h_bps": "pinned_pcie_bps", "d2d_bps": "d2d_bps", "map_bps": "map_bps",
                   "unmap_bps": "unmap_bps", "tensor_host_s": "sync_tensor_seconds",
                   "h2d_kernel_bps": "kernel_h2d_bps", "sync_copy_bps": "sync_copy_bps",
                   "decode_floor_s": "decode_floor_s", "decode_per_seq_s": "decode_per_seq_s",
                   "adapter_tensor_s": "adapter_tensor_seconds"}


@dataclasses.dataclass(frozen=True)
class Rates:
    """What calibrate measured: {"d2h_bps", "h2d_bps", "d2d_bps", "h2d_kernel_bps" (CUDA),
    "map_bps", "unmap_bps", "remap_bytes", "weights_map_bps", "weights_remap_bytes",
    "sync_copy_bps", "sync_sample_bytes", "tensor_host_s", "bytes", "decode_floor_s",
    "decode_per_seq_s" (CUDA, measure_decode_rates), "adapter_tensor_s" (LoRA,
    measure_adapter_tensor_seconds)}; a rate that could not be
    measured (nothing fits) is absent and the profile's stands."""

    values: dict

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    @classmethod
    def load(cls, path: str | Path) -> "Rates":
        """The rates of an earlier run: its summary.json (or a JSON of the rates alone)."""
        path = Path(path)
        try:
            data = read_json(path, max_bytes=16 << 20)
        except HandoffError as e:
            raise HandoffError(f"run.rates_file: {e}; pass the summary.json of a finished run "
                               "on this card") from None
        values = data.get("rates", data)
        if not isinstance(values, dict) or "d2h_bps" not in values:
            raise HandoffError(f"run.rates_file={str(path)!r} holds no measured rates: pass the "
                               "summary.json of a finished `handoff train` run")
        for key in values:   # every rate prices the ledger: a number, and not below 0
            expect(values, key, (int, float), source=f"run.rates_file={str(path)!r}", lo=0)
        return cls(values)

    def profile(self, hw: HardwareProfile) -> HardwareProfile:
        """`hw` with every measured rate in place of the profile's."""
        return dataclasses.replace(hw, **{field: self.values[key] for key, field
                                          in _PROFILE_FIELDS.items() if key in self.values})


def calibrate(cfg: Config, plan: RunPlan, actor, pool: RegionPool) -> Rates:
    """Measure every rate (module docstring) on `pool`'s device. Call it with the trainer's
    state where the rollout phase keeps it and before the engine takes its KV pool; the
    actor's params are brought to the card for the sync's measurement and sent back."""
    device = pool.device
    values = measure_link_rates(device)
    borrow = cfg.memory.param_offload
    if borrow:
        actor.to("device", params=True).wait()
    values.update(measure_sync_copy_bps(device, actor.full_params,
                                        bucket_bytes=cfg.sync.bucket_mb << 20))
    if borrow:
        actor.to("host", params=True).wait()
        aggressive_empty_cache()
    kv_bytes, weight_bytes, freed = _switch_sizes(cfg, plan, pool)
    on_cuda = device.type == "cuda"
    # Four pairs: one pair's times vary by a quarter from step to step.
    elastic = cfg.rollout.kv_pool == "elastic"
    values.update(measure_remap_rates(device, kv_bytes, pool=pool, repeats=4,
                                      held_during_wake=weight_bytes, freed_before_wake=freed,
                                      settle_s=2.0 if on_cuda else 0.0,
                                      slabs=2 * plan.shape.num_layers if elastic else 0))
    if weight_bytes:   # none under LoRA on a shared base: its weights never leave the card
        weights = measure_remap_rates(device, weight_bytes, pool=pool, tag="calibrate_weights")
        values.update(weights_map_bps=weights["map_bps"],
                      weights_remap_bytes=weights["remap_bytes"])
    values["tensor_host_s"] = measure_tensor_host_seconds(
        device, module=actor.module, d2h_in_flight_bytes=optimizer_d2h_bytes(plan.order, actor))
    return Rates(values)


def optimizer_d2h_bytes(order: SwitchOrder, actor) -> int:
    """What the switch's optimizer offload has in flight while the sync runs: all of it
    where `order` starts the copy before the sync (in turn, and on a fixed pool), none where
    it starts under the next generation (streamed on an elastic pool: after the sync) or
    the optimizer stays on the card. Where the engine's weights do not fit beside the copy,
    the sync's wake lands it first (worker._wake_weights): then the sync runs alone after
    all, and is priced as if beside it."""
    move = order.get("optimizer_d2h")
    return actor.memory_parts()["optimizer"] if move is not None and move.phase == "to_rollout" \
        else 0


def _switch_sizes(cfg: Config, plan: RunPlan, pool: RegionPool) -> tuple[int, int, list]:
    """(KV pool, engine weights) bytes the engine is about to take, each at most what is free
    now less the wake margin and 1 GiB (weights 0 under LoRA on a shared base: mapped
    already, and they stay); and [(bytes, seconds before the KV wake)] that to_rollout hands
    back to the driver: the optimizer once its copy ends (the params' copy still to go),
    then the params and the sync's two buckets right before the wake. The pool is sized by
    the engine's own rule, with the planner's activation peak and graph pool for the ones
    the engine profiles.

    A shared LoRA base's trainer hands back its activations right before the wake, which
    this does not replay: pages handed back a moment before a map change its rate both
    ways, 7-30x faster after 12 GiB, 10x slower after 30 GiB (36 GiB region, H100:
    scripts/device/calib_probe.py, docs/PERF.md), so a replay of the planner's activation
    estimate priced a 14B run's wake at 9x what it took."""
    shape, dtypes, hw = plan.shape, plan.dtypes, plan.hardware
    ro, tp = cfg.rollout, cfg.parallel.tp
    weights = engine_weight_bytes(shape, tp, dtypes.engine_bytes)
    block = int(kv_bytes_per_token_per_card(shape, tp, dtypes.kv_bytes)) * ro.block_size
    on_cuda = pool.device.type == "cuda"
    free, total = (torch.cuda.mem_get_info(pool.device) if on_cuda
                   else (host_memory()[1] or 1 << 62, 0))
    overhead = int(hw.activation_peak_bytes + hw.graph_pool_bytes)
    room = free - pool.wake_margin_bytes - (1 << 30)
    elastic = ro.kv_pool == "elastic"
    if elastic and on_cuda and ro.num_blocks is None:
        # An elastic wake maps what is free less the engine's overhead, not a utilization's
        # share: the 14B's pool was 46 GiB where the share gave 37, and a larger unmap is
        # slower a byte (scripts/device/map_probe.py --sleep).
        room -= overhead
    blocks = kv_pool_blocks(ro, block_bytes=block, on_cuda=on_cuda, elastic=elastic,
                            max_model_len=ro.max_model_len, hbm_bytes=total,
                            weights_bytes=weights, overhead_bytes=overhead)
    if cfg.actor.lora.shares_base:   # the weights are mapped already (the trainer's base) and
        # `free` excludes them
        return int(max(min(blocks * block, room), block)), 0, []
    weights = int(max(min(weights, room), 1))
    params, optimizer = _offloaded_bytes(cfg, plan)
    late = min(params + 2 * (cfg.sync.bucket_mb << 20), room - weights)
    early = optimizer if cfg.memory.optimizer_offload else 0
    early = min(early, room - weights - late)
    freed = [(int(late), 0.0)] + ([(int(early), params / hw.pinned_pcie_bps)] if early > 0 else [])
    # The weights are held while the KV region wakes: both fit in the room.
    return int(max(min(blocks * block, room - weights), block)), weights, freed


def _offloaded_bytes(cfg: Config, plan: RunPlan) -> tuple[int, int]:
    """(params, optimizer state) bytes to_rollout hands back to the driver before the KV
    wake: a full model's, or under LoRA with the base held twice the trainer's base and
    adapters (memory.param_offload) and the adapters' Adam state (replaying a full model's
    frees priced a LoRA wake at 10x its time)."""
    shape, dtypes, mem = plan.shape, plan.dtypes, cfg.memory
    lora = cfg.actor.lora
    if not lora.rank:
        owners = trainer_bytes(shape, plan.shard, dtypes, ref=False)
        return owners["params"] if mem.param_offload else 0, owners["optimizer"]
    state = adapter_state_bytes(adapter_params(shape, lora.rank, lora.target_modules), dtypes)
    bases = BaseCopies.of_run(shape, lora, mem, cfg.parallel, dtypes)
    params = bases.trainer + state["adapter_params"] if mem.param_offload else 0
    return params, state["adapter_optimizer"]


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall seconds of `fn` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        wait_for_device(device)
        t0 = time.perf_counter()
        fn()
        wait_for_device(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_link_rates(device: torch.device, nbytes: int = 256 << 20, repeats: int = 3) -> dict:
    """Bytes/s of a pinned D2H, a pinned H2D and a device-to-device copy (read + write); on
    CUDA also "h2d_kernel_bps", the H2D done by a kernel."""
    pin = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    other = torch.empty_like(dev)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=pin), device, repeats)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=pin), device, repeats)
    d2d = _timed(lambda: other.copy_(dev), device, repeats)
    rates = {"d2h_bps": nbytes / d2h, "h2d_bps": nbytes / h2d, "d2d_bps": 2 * nbytes / d2d,
             "bytes": nbytes}
    if pin:
        rates["h2d_kernel_bps"] = nbytes / _timed(lambda: copy_from_host(dev, host), device,
                                                  repeats)
    return rates


def _touched(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """`nbytes` of written memory (None for 0)."""
    return torch.ones(int(nbytes), dtype=torch.uint8, device=device) if nbytes > 0 else None


def measure_remap_rates(device: torch.device, nbytes: int, *, repeats: int = 3,
                        pool: RegionPool | None = None, tag: str = "calibrate",
                        held_during_wake: int = 0,
                        freed_before_wake: Sequence[tuple[int, float]] = (),
                        settle_s: float = 0.0, slabs: int = 0) -> dict:
    """Bytes/s of waking (map) and level-2 sleeping (unmap) one region of one `nbytes` tensor:
    medians over `repeats` pairs after a warm-up, {"map_bps", "unmap_bps", "remap_bytes"}
    (remap_bytes: what a wake maps, allocator granularity included). With `slabs` the region
    is an elastic arena of that many slabs (rollout.kv_pool=elastic: one per layer's K or V)
    instead of one torch_memory_saver allocation.

    The wake happens in a switch's state: `held_during_wake` bytes in use elsewhere,
    `freed_before_wake` = [(bytes, seconds before the wake)] of touched memory handed back
    at those times, the region's own pages released `settle_s` before; each sleep comes
    `settle_s` after a wake with the region written, as a step's pool sleeps after the
    rollout. The region is left asleep: torch_memory_saver keeps its virtual range (address
    space only) for the life of the process. Pass the run's pool, so its meter sees it.
    """
    pool = pool if pool is not None else RegionPool(device)
    if slabs:
        block = _elastic_region(pool, tag, int(nbytes), slabs)
    else:
        with pool.region(tag):
            block = torch.empty(int(nbytes), dtype=torch.uint8, device=pool.device)
        pool.track(tag, block)
    block.fill_(1)  # touch every page: a CPU region is only real once written
    remap_bytes = mapped = pool.region_bytes(tag)
    sleeps, wakes = [], []   # (bytes, seconds): an elastic wake maps what is free, at most all
    for repeat in range(repeats + 1):
        if repeat:
            block.fill_(1)
            wait_for_device(pool.device)
            time.sleep(settle_s)
        wait_for_device(pool.device)
        t0 = time.perf_counter()
        pool.sleep([tag], level=2)
        wait_for_device(pool.device)
        sleeps.append((mapped, time.perf_counter() - t0))
        time.sleep(settle_s)
        held = _touched(held_during_wake, pool.device)
        releases = sorted(freed_before_wake, key=lambda r: -r[1])  # the earliest first
        blocks = [_touched(n, pool.device) for n, _ in releases]
        for i, (_, lead) in enumerate(releases):
            blocks[i] = None
            aggressive_empty_cache()  # the bytes go back to the driver, as in the switch
            time.sleep(max(lead - (releases[i + 1][1] if i + 1 < len(releases) else 0.0), 0.0))
        t1 = time.perf_counter()
        pool.wake_up([tag])
        wait_for_device(pool.device)
        mapped = pool.region_bytes(tag)
        wakes.append((mapped, time.perf_counter() - t1))
        del held
    pool.sleep([tag], level=2)
    del block
    aggressive_empty_cache()
    tiny = 1e-9  # a CPU resize can be below the clock's resolution
    return {"map_bps": statistics.median(n / max(s, tiny) for n, s in wakes[1:]),
            "unmap_bps": statistics.median(n / max(s, tiny) for n, s in sleeps[1:]),
            "remap_bytes": remap_bytes}


def _elastic_region(pool: RegionPool, tag: str, nbytes: int, slabs: int) -> torch.Tensor:
    """Elastic region `tag` of `pool` over an arena of `slabs` equal slabs holding at least
    `nbytes` (rounded up to whole granules a slab), mapped whole; returns its bytes. Left
    asleep after the measurement, like a torch_memory_saver region: address space only."""
    granule = ElasticArena.granule_bytes(pool.device)
    slab = -(-nbytes // slabs // granule) * granule
    arena = ElasticArena(pool.device, slabs=slabs, slab_bytes=slab)
    pool.elastic(tag, arena, min_per_slab=slab)
    return arena.view(torch.uint8, (arena.capacity_bytes,))


def _engine_like_loader(plan: dict):
    """A load_weights doing per tensor what the engine's does: a name lookup (`plan`: name ->
    (destination, expected shape, bytes)), a shape check, a touched-set entry, and the
    engine's batched copies."""
    def load(entries) -> None:
        touched = set()

        def copies():
            for name, t in entries:
                dest, expected, nbytes = plan[name]
                if tuple(t.shape) != expected:
                    raise AssertionError(name)
                touched.add(name)
                yield dest, t, nbytes

        copy_in_batches(copies())
    return load


def measure_sync_copy_bps(device: torch.device, params: Callable[[], WeightIter], *,
                          bucket_bytes: int, budget_bytes: int = 8 << 30,
                          repeats: int = 3) -> dict:
    """Bytes read + written per second by an in-process weight sync's copies, on the
    trainer's own tensors: {"sync_copy_bps", "sync_sample_bytes"} ({} when nothing fits).

    Runs the real `sync_weights` over `params()` into scratch destinations. At most
    `budget_bytes` of tensors take part (every k-th, so the sample keeps the model's mix of
    sizes; on CUDA no more than fits). The cache is emptied before each sync: its two
    buckets are allocated inside the timed sync, as in a step's switch.
    """
    if device.type == "cuda":   # the sample's destinations and the buckets must fit
        budget_bytes = min(budget_bytes, torch.cuda.mem_get_info(device)[0]
                           - 2 * bucket_bytes - (1 << 30))
    if budget_bytes <= 0:
        return {}
    # One walk for the sizes (under FSDP each walk all-gathers every tensor).
    metas = [(name, tuple(t.shape), t.dtype, t.numel() * t.element_size())
             for name, t in params()]
    stride = max(-(-sum(m[3] for m in metas) // budget_bytes), 1)
    plan = {name: (torch.empty(shape, dtype=dtype, device=device), shape, nbytes)
            for i, (name, shape, dtype, nbytes) in enumerate(metas) if i % stride == 0}
    load = _engine_like_loader(plan)
    sample = sum(nbytes for _, _, nbytes in plan.values())
    times = []
    for _ in range(repeats + 1):   # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.empty_cache()
        wait_for_device(device)
        t0 = time.perf_counter()
        sync_weights(((n, t) for n, t in params() if n in plan), load,
                     bucket_bytes=bucket_bytes, device=device)
        wait_for_device(device)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:])
    del plan, load
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # Into the bucket and out of it, each a read and a write.
    return {"sync_copy_bps": 4 * sample / max(seconds, 1e-9), "sync_sample_bytes": sample}


def measure_tensor_host_seconds(device: torch.device, *, module: torch.nn.Module | None = None,
                                tensors: int = 256, repeats: int = 3,
                                d2h_in_flight_bytes: int = 0, chunk_bytes: int = 64 << 20,
                                per_bucket: int = 25) -> float:
    """Median wall seconds of one tensor's host-side work in an in-process weight sync.

    Runs the real `sync_weights` with tiny tensors, `per_bucket` to a bucket, named and
    walked as the actor's full_params walks `module`'s parameters (`tensors` made-up names
    without a module), into the engine-like loader: the copies cost nothing on the device,
    what remains is the host's dispatch and launch cost, which the ledger charges per tensor.
    d2h_in_flight_bytes: time it while a D2H of that many bytes is queued on another stream.
    """
    names = ([name for name, _ in module.named_parameters()] if module is not None
             else [f"w{i}" for i in range(tensors)])
    tensors = len(names)
    tiny = [torch.randn(64, device=device) for _ in names]
    plan = {name: (torch.empty_like(t), (64,), 256) for name, t in zip(names, tiny)}

    def walk():
        if module is None:
            yield from ((name, t.detach()) for name, t in zip(names, tiny))
            return
        for (name, p), t in zip(module.named_parameters(), tiny):
            getattr(p, "_local_tensor", p).detach()   # full_params' work per parameter
            yield name, t

    load = _engine_like_loader(plan)

    def one_sync() -> None:
        sync_weights(walk(), load, bucket_bytes=per_bucket * 64 * 4, device=device)

    return _timed_beside_d2h(one_sync, device, repeats, d2h_in_flight_bytes,
                             chunk_bytes) / tensors


def _timed_beside_d2h(fn: Callable[[], None], device: torch.device, repeats: int,
                      d2h_bytes: int, chunk_bytes: int = 64 << 20) -> float:
    """Median wall seconds of `fn` (after one warm-up), each call started while a D2H of
    `d2h_bytes` is in flight on another stream, as the switch's sync runs beside the
    optimizer's offload; without one (or off CUDA), _timed."""
    if not d2h_bytes or device.type != "cuda":
        return _timed(fn, device, repeats)
    chunk = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
    copies = torch.cuda.Stream(device)
    copied = torch.cuda.Event()

    def queue_copies() -> None:
        with torch.cuda.stream(copies):
            for _ in range(-(-d2h_bytes // chunk_bytes)):
                host.copy_(chunk, non_blocking=True)
        copied.record(copies)

    fn()
    wait_for_device(device)
    seconds = _timed_while(fn, repeats, start_beside=queue_copies, beside_done=copied.query,
                           wait=torch.cuda.current_stream(device).synchronize)
    wait_for_device(device)
    return seconds


def _timed_while(fn: Callable[[], None], repeats: int, *, start_beside: Callable[[], None],
                 beside_done: Callable[[], bool], wait: Callable[[], None]) -> float:
    """Median wall seconds of `fn` then `wait`, each call started with the work that
    `start_beside` queues in flight: queued before the first call and again before any call
    that would find it done (a call longer than the copies, the adapters' load of a large
    model, would otherwise run beside them only the first time)."""
    times = []
    for i in range(repeats):
        if i == 0 or beside_done():
            start_beside()
        t0 = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_adapter_tensor_seconds(actor, engine, *, repeats: int = 3,
                                   d2h_in_flight_bytes: int = 0) -> float:
    """Wall seconds per tensor of the LoRA sync (the switch's engine_weights_sync under LoRA,
    priced per tensor): the actor's adapters loaded into the engine's buffers as they are
    now, which the first step's sync loads again; the median of `repeats` loads after the
    first, which zeroes the buffers (a new layout; the later ones, as in the steps, do not).
    d2h_in_flight_bytes: timed while a D2H of that many bytes is queued (the switch syncs
    while the adapters' Adam state goes to the host)."""
    lora = actor.lora
    num = []

    def one_load() -> None:
        stats = sync_adapters(actor.adapter_tensors(engine.dtype), engine.lora.load,
                              alpha=lora.alpha, rank=lora.rank, device=engine.device)
        num.append(stats.num_tensors)

    seconds = _timed_beside_d2h(one_load, engine.device, repeats, d2h_in_flight_bytes)
    engine.reset_prefix_cache()   # loaded beside load_adapter: no KV of other adapters kept
    return seconds / max(num[-1], 1)


def measure_decode_rates(engine, *, batch: int, steps: int = 32) -> dict:
    """The engine's decode step with 1 and with `batch` short sequences: its floor (weights,
    launches, sampling, the host's turn) and what each further sequence adds beyond reading
    its KV (priced at the profile's decode bandwidth). Fixed seeds: the engine's own seed
    stream is not advanced, so the run samples what it would have without this."""
    from handoff.rollout.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=steps, ignore_eos=True, seed=0)

    def step_seconds(rows: int) -> float:
        before = engine.stats()
        engine.generate([[1] * 16] * rows, params)
        after = engine.stats()
        engine.reset_prefix_cache()
        return ((after["decode_seconds"] - before["decode_seconds"])
                / max(after["decode_steps"] - before["decode_steps"], 1))

    step_seconds(1)   # warm-up: first-call compiles and allocations
    floor = step_seconds(1)
    full = step_seconds(batch)
    return {"decode_floor_s": floor, "decode_per_seq_s": max(full - floor, 0.0) / max(batch - 1, 1)}
