"""Where LoRA on one copy of the base ends: its hard limits and safe utilization.

    v = decide_lora(shape, parallel, memory, hw, adapters=n, workload=wl, utilization=0.5, ...)

The limits of plan/verdict.py, with the base counted once (plan/lora.py; held twice,
share_base=false: the trainer's own in the update, the engine's while it generates, both in
BaseCopies):
* the training peak is the base (2N, whole, mapped in the engine's region and kept through
  training; held twice: the trainer's own shard, the engine's on the host) + the adapters'
  state (16 B per adapter parameter) + the trainer's activations, under TRAIN_PEAK_FRACTION
  of HBM: the base must fit one card beside them;
* the engine's budget holds the base, its adapters, the KV pool, its activation peak and
  CUDA graphs: the pool is what they leave;
* a shared base needs an engine of TP 1: only then is each card's base whole, the same
  tensors the trainer's frozen layers view (a TP engine needs the base held twice);
* pinned host RAM holds the adapters' offloaded optimizer state (held twice: and the engine's
  base, backed up at each sleep, and the trainer's under memory.param_offload).
The fragmentation share is taken of the adapters' state and the activations only: the base is
mapped once and never freed, so it does not churn the allocator.
"""

from __future__ import annotations

import math

from handoff.config import MemoryConfig, ParallelConfig
from handoff.plan.hardware import GB, HardwareProfile
from handoff.plan.kvpool import (Workload, kv_bytes_per_token_per_card, kv_pool_bytes,
                                 kv_shortfall)
from handoff.plan.ledger import Dtypes
from handoff.plan.lora import BaseCopies, adapter_state_bytes, lora_trainer_left_bytes
from handoff.plan.shapes import ModelShape
from handoff.plan.verdict import (FRAGMENTATION_SHARE, HOST_FRACTION, SLOW_SYNC_SECONDS,
                                  TRAIN_PEAK_FRACTION, Verdict, choose_mode)


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def lora_working_set_bytes(adapters: int, dtypes: Dtypes, hw: HardwareProfile) -> float:
    """What the trainer allocates and frees each step: the adapters' state + activations."""
    return sum(adapter_state_bytes(adapters, dtypes).values()) + hw.train_activation_bytes


def lora_training_peak_bytes(shape: ModelShape, adapters: int, dtypes: Dtypes,
                             hw: HardwareProfile, bases: BaseCopies | None = None) -> float:
    """The trainer's base (shared: the base once) + the adapters' state + the trainer's
    activations, per card."""
    bases = bases or BaseCopies.shared_of(shape, dtypes)
    return bases.trainer + lora_working_set_bytes(adapters, dtypes, hw)


def lora_max_safe_utilization(adapters: int, memory: MemoryConfig, hw: HardwareProfile,
                              dtypes: Dtypes = Dtypes(), bases: BaseCopies | None = None
                              ) -> float:
    """Highest gpu_memory_utilization (0.01 grid) beside the resident bytes, the working
    set's fragmentation share and the trainer state kept through generation."""
    frag = FRAGMENTATION_SHARE * lora_working_set_bytes(adapters, dtypes, hw)
    room = (hw.hbm_bytes - hw.resident_bytes - frag
            - lora_trainer_left_bytes(adapters, memory, dtypes, bases))
    return math.floor(room / hw.hbm_bytes * 100 + 1e-9) / 100


def lora_elastic_utilization(adapters: int, memory: MemoryConfig, hw: HardwareProfile,
                             dtypes: Dtypes = Dtypes(), bases: BaseCopies | None = None
                             ) -> float:
    """The share of HBM an elastic pool's engine holds under LoRA (verdict.elastic_utilization
    with the adapters' state, and a base of the trainer's own, as what the trainer keeps)."""
    room = (hw.hbm_bytes - hw.resident_bytes
            - lora_trainer_left_bytes(adapters, memory, dtypes, bases))
    return room / hw.hbm_bytes


def decide_lora(shape: ModelShape, parallel: ParallelConfig, memory: MemoryConfig,
                hw: HardwareProfile, *, adapters: int, workload: Workload, utilization: float,
                pinned_per_node: float, sync_seconds: float, generation_seconds: float | None,
                tail_seconds: float = 0.0, step_seconds: float | None = None,
                dtypes: Dtypes = Dtypes(), bases: BaseCopies | None = None) -> Verdict:
    """Fits or not under LoRA, the mode, the safe utilization, why (module docstring);
    `bases`: a base held twice (None: shared)."""
    bases = bases or BaseCopies.shared_of(shape, dtypes)
    reasons: list[str] = []
    fixes: list[str] = []
    if shape.runtime_refusal:
        reasons.append(f"does not fit: {shape.runtime_refusal}")
        fixes.append("runtime")
    if bases.shared and parallel.tp != 1:
        reasons.append(f"does not fit: engine TP {parallel.tp}: LoRA shares the base between "
                       "the engine and the trainer only with an engine of TP 1 (the base whole "
                       "on each card); pass --tp 1, or actor.lora.share_base=false")
        fixes.append("engine TP")
    base = bases.trainer
    which = "the base once" if bases.shared else "the trainer's own base"
    state = sum(adapter_state_bytes(adapters, dtypes).values())
    peak = lora_training_peak_bytes(shape, adapters, dtypes, hw, bases)
    limit = TRAIN_PEAK_FRACTION * hw.hbm_bytes
    if peak > limit:
        reasons.append(f"does not fit: {which} {_gb(base)} + the adapters' state {_gb(state)} "
                       f"+ activations {_gb(hw.train_activation_bytes)} > {_gb(limit)} "
                       f"({TRAIN_PEAK_FRACTION:.1%} of HBM): under LoRA the base must fit one "
                       "card beside them")
        fixes.append("training peak")
    else:
        reasons.append(f"training peak {_gb(peak)} per card ({which}, {_gb(base)}) fits "
                       f"under {_gb(limit)}")
    if pinned_per_node > HOST_FRACTION * hw.host_ram_bytes:
        reasons.append(f"does not fit: {_gb(pinned_per_node)} pinned host RAM per node > half "
                       f"of {_gb(hw.host_ram_bytes)}")
        fixes.append("pinned host RAM")
    max_util = lora_max_safe_utilization(adapters, memory, hw, dtypes, bases)
    weights = bases.engine + bases.engine_adapters
    seq = workload.mean_context * kv_bytes_per_token_per_card(shape, parallel.tp,
                                                              dtypes.kv_bytes)
    if max_util <= 0 or kv_pool_bytes(max_util, hw, weights) < seq:
        reasons.append(f"does not fit: the base and adapters ({_gb(weights)}) leave the engine "
                       f"no KV pool at the highest safe utilization {max(max_util, 0):.2f}")
        fixes.append("KV pool at the safe utilization")
    else:
        reasons.append(f"highest safe gpu_memory_utilization {max_util:.2f}: KV pool "
                       f"{_gb(kv_pool_bytes(max_util, hw, weights))} beside the base "
                       f"{_gb(bases.engine)} and the adapters"
                       + ("" if bases.shared or not bases.kept_generating else
                          f" (and the trainer's own base, {_gb(bases.kept_generating)})"))
    shortfall = kv_shortfall(utilization, hw, weights)
    if shortfall is not None:
        reasons.append(f"does not fit: {shortfall}")
        fixes.append("KV pool at the requested utilization")
    if 0 < max_util < utilization:
        reasons.append(f"requested utilization {utilization:g} is above the safe {max_util:.2f}: "
                       "expect OOMs that come and go between steps")
    tail_share = tail_seconds / generation_seconds if generation_seconds else None
    mode = None
    if not fixes or fixes == ["runtime"]:
        mode = choose_mode(parallel, hw, max_util, reasons, tail_share=tail_share,
                           generation_seconds=generation_seconds, step_seconds=step_seconds)
        if sync_seconds > SLOW_SYNC_SECONDS:
            reasons.append(f"adapter sync takes {sync_seconds:.0f} s per step")
    fix = None
    if fixes:
        first = next(r for r in reasons if r.startswith("does not fit"))
        fix = f"{shape.name} on {parallel.gpus} cards with LoRA {first}"
    return Verdict(fits=not fixes, mode=mode, max_utilization=max_util, min_tp=1, reasons=reasons,
                   fix=fix, long_tail_share=tail_share, runnable=shape.runtime_refusal is None)
