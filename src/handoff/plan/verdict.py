"""Where colocation ends: hard limits, the mode, the highest safe utilization, in words.

    v = decide(shape, cfg.parallel, cfg.memory, hw, ...)
    v.fits, v.mode, v.max_utilization, v.reasons

Hard limits (any one failing: the run does not fit; every failing one is a reason):
* the runtime runs the model (dense qwen3, qwen2, llama: plan/model_checks.py); a MoE or
  MLA model is priced for sizing, and its verdict says a run cannot start;
* training peak 16N/n + activations <= TRAIN_PEAK_FRACTION x HBM (70 GB of an 80 GB card:
  NCCL buffers, the allocator and the engine's resident pool take the rest);
* pinned host state per node <= HOST_FRACTION of host RAM (the source: 16N <= half of it);
* the engine's weights must leave a KV pool at the highest safe utilization (else: more TP),
  and at the requested one;
* the engine's TP must divide the attention heads, and divide or be a multiple of the KV
  heads (the engine's shard rules).
What to change instead is not guessed here: plan/advice.py searches for a plan that fits.

The highest safe utilization is derived from memory, not looked up: during generation the
card also holds what no allocator gives back (the profile's resident bytes), the trainer
state that is not offloaded, and allocator fragmentation, which grows with the trainer's
working set ("step 1 fits, step 37 OOMs"). We leave FRAGMENTATION_SHARE of the trainer's
per-card peak for it, calibrated on the source's tight case (32B on 8 cards, both offloads:
0.6-0.7). What that gives (80 GB card): both offloads on a small per-card state 0.8-0.85,
optimizer kept on the card 0.6-0.7 when its shard is ~13 GB (70B / 64 cards), 0.2-0.3 when it
is 49 GB (32B / 8 cards), no offload <= 0.5 unless the state per card is small.

Mode, in the order the source lists the signals: > 128 cards, an engine group that spans
nodes (its layout cannot share the trainer's cards), or utilization below 0.7 while
generation is > 70% of the step -> disaggregate; a long tail > 40% of generation ->
colocate_async; otherwise colocate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from handoff.config import MemoryConfig, ParallelConfig
from handoff.plan.hardware import GB, HardwareProfile
from handoff.plan.kvpool import (Workload, engine_weight_bytes, kv_bytes_per_token_per_card,
                                 kv_pool_bytes, kv_shortfall)
from handoff.plan.ledger import Dtypes, shard_size, trainer_bytes
from handoff.plan.shapes import ModelShape
from handoff.plan.trainer import full_train_state_bytes

TRAIN_PEAK_FRACTION = 0.875
HOST_FRACTION = 0.5
FRAGMENTATION_SHARE = 0.25
MAX_COLOCATED_CARDS = 128
LONG_TAIL_SHARE = 0.4
GEN_HEAVY_SHARE = 0.7
GEN_HEAVY_MIN_UTIL = 0.7
SLOW_SYNC_SECONDS = 10.0
CAPPED_UTIL = 0.8


@dataclass
class Verdict:
    fits: bool
    mode: str | None                  # colocate | colocate_async | disaggregate | None
    max_utilization: float | None
    min_tp: int | None
    reasons: list[str] = field(default_factory=list)
    fix: str | None = None            # one line when it does not fit: the cause, the advice
    long_tail_share: float | None = None
    advice: dict | None = None        # plan/advice.py: the overrides of a plan that fits
    runnable: bool = True             # False: no layout helps, the runtime cannot run the model

    def to_dict(self) -> dict:
        return asdict(self)


def training_peak_bytes(shape: ModelShape, shard: int, dtypes: Dtypes,
                        hw: HardwareProfile) -> float:
    """16N/n (params, grads, master, Adam) + the trainer's activations, per card."""
    return full_train_state_bytes(shape, dtypes, shard) + hw.train_activation_bytes


def min_training_cards(shape: ModelShape, dtypes: Dtypes, hw: HardwareProfile) -> int:
    """Fewest cards whose shard keeps the training peak under the limit (FSDP shards over
    any count); 0 when no count does (the activations alone exceed it)."""
    room = TRAIN_PEAK_FRACTION * hw.hbm_bytes - hw.train_activation_bytes
    if room <= 0:
        return 0
    cards = max(math.ceil(shape.num_params * dtypes.train_state_bytes / room), 1)
    while training_peak_bytes(shape, cards, dtypes, hw) > TRAIN_PEAK_FRACTION * hw.hbm_bytes:
        cards += 1   # the per-card state is rounded up to whole bytes
    return cards


def trainer_left_bytes(shape: ModelShape, parallel: ParallelConfig, memory: MemoryConfig,
                       dtypes: Dtypes, ref: bool) -> int:
    """Trainer state that stays on the card during generation (what is not offloaded)."""
    owners = trainer_bytes(shape, shard_size(parallel), dtypes, ref=ref)
    return ((0 if memory.param_offload else owners["params"])
            + (0 if memory.optimizer_offload else owners["optimizer"])
            + (0 if memory.ref_offload else owners["reference"]))


def max_safe_utilization(shape: ModelShape, parallel: ParallelConfig, memory: MemoryConfig,
                         hw: HardwareProfile, *, dtypes: Dtypes = Dtypes(),
                         ref: bool = True) -> float:
    """Highest gpu_memory_utilization (0.01 grid, may be <= 0) that leaves room for the rest."""
    frag = FRAGMENTATION_SHARE * training_peak_bytes(shape, shard_size(parallel), dtypes, hw)
    room = (hw.hbm_bytes - hw.resident_bytes - frag
            - trainer_left_bytes(shape, parallel, memory, dtypes, ref))
    return math.floor(room / hw.hbm_bytes * 100 + 1e-9) / 100


def elastic_utilization(shape: ModelShape, parallel: ParallelConfig, memory: MemoryConfig,
                        hw: HardwareProfile, *, dtypes: Dtypes = Dtypes(),
                        ref: bool = True) -> float:
    """The share of HBM an elastic pool's engine holds (rollout.kv_pool=elastic): all the
    card has free once the trainer's state has left, less what no allocator returns and what
    the trainer keeps on the card; no utilization to choose, no fragmentation share (the pool
    maps what is free, not what was planned)."""
    room = (hw.hbm_bytes - hw.resident_bytes
            - trainer_left_bytes(shape, parallel, memory, dtypes, ref))
    return room / hw.hbm_bytes


def min_engine_tp(shape: ModelShape, hw: HardwareProfile, *, utilization: float, gpus: int,
                  workload: Workload, dtypes: Dtypes = Dtypes()) -> int | None:
    """Smallest power-of-two TP (dividing the cards) whose KV pool holds one mean sequence."""
    tp = 1
    while tp <= gpus:
        if gpus % tp == 0:
            weights = engine_weight_bytes(shape, tp, dtypes.engine_bytes)
            seq = workload.mean_context * kv_bytes_per_token_per_card(shape, tp, dtypes.kv_bytes)
            if kv_pool_bytes(utilization, hw, weights) >= seq:
                return tp
        tp *= 2
    return None


def tp_layout_problems(shape: ModelShape, tp: int) -> list[str]:
    """Why the engine cannot shard this model over `tp` ranks (empty: it can)."""
    problems = []
    if shape.num_heads % tp:
        problems.append(f"engine TP {tp} does not divide the {shape.num_heads} attention heads")
    kv = shape.num_kv_heads
    if not shape.kv_latent_dim and kv % tp and tp % kv:
        problems.append(f"engine TP {tp} and the {kv} KV heads do not divide one another")
    return problems


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def decide(shape: ModelShape, parallel: ParallelConfig, memory: MemoryConfig,
           hw: HardwareProfile, *, workload: Workload, dtypes: Dtypes = Dtypes(),
           ref: bool = True, utilization: float, pinned_per_node: float, sync_seconds: float,
           generation_seconds: float | None, tail_seconds: float = 0.0,
           step_seconds: float | None = None) -> Verdict:
    """Fits or not, colocate / colocate_async / disaggregate, the safe utilization, why."""
    reasons: list[str] = []
    fixes: list[str] = []   # one entry per hard limit that fails
    refusal = shape.runtime_refusal
    if refusal:
        reasons.append(f"does not fit: {refusal}")
        fixes.append("runtime")
    shard = shard_size(parallel)
    peak = training_peak_bytes(shape, shard, dtypes, hw)
    limit = TRAIN_PEAK_FRACTION * hw.hbm_bytes
    state = peak - hw.train_activation_bytes
    if peak > limit:
        cards = min_training_cards(shape, dtypes, hw)
        reasons.append(f"does not fit: training state {_gb(state)} per card "
                       f"({dtypes.train_state_bytes}N/{shard}) + activations "
                       f"{_gb(hw.train_activation_bytes)} > {_gb(limit)} "
                       f"({TRAIN_PEAK_FRACTION:.1%} of HBM): the trainer needs a shard "
                       f"group of >= {cards} cards")
        fixes.append("training peak")
    else:
        reasons.append(f"training peak {_gb(peak)} per card fits under {_gb(limit)}")
    host_limit = HOST_FRACTION * hw.host_ram_bytes
    if pinned_per_node > host_limit:
        reasons.append(f"does not fit: {_gb(pinned_per_node)} pinned host RAM per node > half "
                       f"of {_gb(hw.host_ram_bytes)}")
        fixes.append("pinned host RAM")
    max_util = max_safe_utilization(shape, parallel, memory, hw, dtypes=dtypes, ref=ref)
    left = trainer_left_bytes(shape, parallel, memory, dtypes, ref)
    weights = engine_weight_bytes(shape, parallel.tp, dtypes.engine_bytes)
    seq = workload.mean_context * kv_bytes_per_token_per_card(shape, parallel.tp, dtypes.kv_bytes)
    min_tp = min_engine_tp(shape, hw, utilization=max(max_util, 0.0), gpus=parallel.gpus,
                           workload=workload, dtypes=dtypes)
    if max_util <= 0 or kv_pool_bytes(max_util, hw, weights) < seq:
        if left and (max_util <= 0 or min_tp is None):
            reasons.append(f"does not fit: {_gb(left)} of trainer state stays on the card during "
                           f"generation, leaving the engine no KV pool")
        elif max_util <= 0:
            reasons.append(f"does not fit: no gpu_memory_utilization is safe: "
                           f"{_gb(hw.resident_bytes)} resident and {_gb(FRAGMENTATION_SHARE * peak)}"
                           f" for fragmentation ({FRAGMENTATION_SHARE:.0%} of the training peak) "
                           f"fill the {_gb(hw.hbm_bytes)} card")
        else:
            reasons.append(f"does not fit: engine weights {_gb(weights)} per card (TP="
                           f"{parallel.tp}) leave no KV pool at utilization {max_util:.2f}")
        fixes.append("KV pool at the safe utilization")
    else:
        kept = f"; {_gb(left)} of trainer state stays on the card" if left else ""
        reasons.append(f"highest safe gpu_memory_utilization {max_util:.2f}: "
                       f"{_gb(hw.resident_bytes)} resident, {FRAGMENTATION_SHARE:.0%} of the "
                       f"training peak for fragmentation{kept}")
        if max_util < CAPPED_UTIL:
            reasons.append(f"KV pool capped: {_gb(kv_pool_bytes(max_util, hw, weights))} at "
                           f"{max_util:.2f}, {_gb(kv_pool_bytes(1.0, hw, weights))} on an "
                           "exclusive card")
    shortfall = kv_shortfall(utilization, hw, weights)
    if shortfall is not None:
        reasons.append(f"does not fit: {shortfall}")
        fixes.append("KV pool at the requested utilization")
    for problem in tp_layout_problems(shape, parallel.tp):
        reasons.append(f"does not fit: {problem}")
        fixes.append("engine TP layout")
    if 0 < max_util < utilization:
        reasons.append(f"requested utilization {utilization:g} is above the safe {max_util:.2f}: "
                       "expect OOMs that come and go between steps")
    if min_tp is not None and min_tp > 1:
        full = shape.num_params * dtypes.engine_bytes
        reasons.append(f"the engine needs TP >= {min_tp} (its weights are {_gb(full)})")
    fits = not fixes
    tail_share = tail_seconds / generation_seconds if generation_seconds else None
    mode: str | None = None
    if not fixes or fixes == ["runtime"]:   # a model only priced still gets its mode's signals
        mode = choose_mode(parallel, hw, max_util, reasons, tail_share=tail_share,
                           generation_seconds=generation_seconds, step_seconds=step_seconds)
        if sync_seconds > SLOW_SYNC_SECONDS:
            reasons.append(f"weight sync takes {sync_seconds:.0f} s per step "
                           "(all-gather + buckets)")
    fix = None
    if fixes:
        first = next(r for r in reasons if r.startswith("does not fit"))
        fix = f"{shape.name} on {parallel.gpus} cards {first}"
    return Verdict(fits=fits, mode=mode, max_utilization=max_util, min_tp=min_tp,
                   reasons=reasons, fix=fix, long_tail_share=tail_share,
                   runnable=refusal is None)


def choose_mode(parallel: ParallelConfig, hw: HardwareProfile, max_util: float,
                reasons: list[str], *, tail_share: float | None,
                generation_seconds: float | None, step_seconds: float | None) -> str:
    """The mode from the module docstring's signals; each one found is added to `reasons`."""
    signals = []
    if parallel.gpus > MAX_COLOCATED_CARDS:
        signals.append(f"{parallel.gpus} cards > {MAX_COLOCATED_CARDS}: colocation's long-tail "
                       "waste grows with the card count")
    if parallel.tp > hw.gpus_per_node:
        signals.append(f"the engine group (TP={parallel.tp}) spans nodes: its layout cannot "
                       "share the trainer's cards without a reshard every step")
    gen_share = generation_seconds / step_seconds if generation_seconds and step_seconds else None
    if gen_share is not None and gen_share > GEN_HEAVY_SHARE and max_util < GEN_HEAVY_MIN_UTIL:
        signals.append(f"utilization cannot reach {GEN_HEAVY_MIN_UTIL} while generation is "
                       f"{gen_share:.0%} of the step")
    if signals:
        reasons.extend(f"disaggregate: {s}" for s in signals)
        return "disaggregate"
    if tail_share is not None and tail_share > LONG_TAIL_SHARE:
        reasons.append(f"colocate_async: the long tail is {tail_share:.0%} of generation "
                       f"(> {LONG_TAIL_SHARE:.0%})")
        return "colocate_async"
    reasons.append("colocate: the switch is cheap next to the step; tune the utilization")
    return "colocate"
