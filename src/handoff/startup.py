"""What a run does before its first step, in the order the card needs it.

    worker, rates = start_worker(cfg, plan)          # plan: runplan.RunPlan.build(cfg)

1. the device, the process group (torchrun's ranks, or a 1-process group), the memory room
   (pinned arena, region pool, meter);
2. the actor and the reference, loaded onto the card;
3. their state sent where the rollout phase keeps it (the run starts in the rollout phase);
4. every rate the ledger prices with, measured on the card the engine is about to take (or
   read from an earlier run's summary.json: run.rates_file);
5. the engine, which sizes its KV pool from what is free now, and (CUDA, when the rates were
   measured here) its decode step at one and at max_num_seqs sequences.

LoRA on one copy of the base (actor.lora.share_base) puts the engine first: the actor's
frozen base is a view of its weights (trainer/lora.py), which never move, so its KV pool
sleeps while the actor is built and the rates measured, and wakes last. memory.param_offload
has nothing to move then (the base stays, the adapters are megabytes): it is turned off,
said once. Under LoRA the engine's decode graphs capture adapter buffers of the run's rank.
"""

from __future__ import annotations

import dataclasses

import torch

from handoff.calibrate import (Rates, calibrate, measure_adapter_tensor_seconds,
                               measure_decode_rates, optimizer_d2h_bytes)
from handoff.config import Config
from handoff.dist import check_world_size, init_process_group, resolve_device
from handoff.memory.allocator import aggressive_empty_cache
from handoff.memory.meter import MemoryMeter
from handoff.memory.regions import RegionPool
from handoff.memory.staging import PinnedArena
from handoff.model_files import ModelFiles
from handoff.rollout.engine import Engine
from handoff.rollout.parallel import init_tp_group
from handoff.runplan import RunPlan
from handoff.trainer.actor import build_actor, build_reference
from handoff.switch.worker import HybridWorker


def start_worker(cfg: Config, plan: RunPlan, *, device: str | torch.device | None = None
                 ) -> tuple[HybridWorker, Rates]:
    """This process's worker, in the rollout phase, and the rates measured on its card."""
    device = resolve_device(device or cfg.run.device)
    check_world_size(cfg.parallel.gpus)   # before the rendezvous: every rank sees it alike
    init_process_group(device)
    arena = PinnedArena(pin=device.type == "cuda")
    pool = RegionPool(device, wake_margin_bytes=cfg.memory.wake_margin_mb << 20)
    meter = MemoryMeter(device, pool=pool, arena=arena)
    pool.meter = meter
    # Read and checked once: the trainer and the engine load these very files.
    files = ModelFiles.open(cfg.model.path, flag="model.path")
    engine = None
    if cfg.actor.lora.shares_base:
        cfg = _shared_base_memory(cfg)
        engine = _engine(cfg, files, device, pool)
        engine.sleep_kv()
    actor = build_actor(cfg, plan, device=device, arena=arena, files=files,
                        engine_base=engine.export_weight if engine is not None else None)
    ref = build_reference(cfg, plan, device=device, arena=arena, files=files)
    mem = cfg.memory
    if ref is not None and mem.ref_offload:
        ref.to("host", params=True).wait()
    if mem.param_offload or mem.optimizer_offload:
        actor.to("host", params=mem.param_offload, optimizer=mem.optimizer_offload).wait()
    aggressive_empty_cache()
    rates = Rates.load(cfg.run.rates_file) if cfg.run.rates_file else calibrate(cfg, plan, actor, pool)
    if engine is None:
        engine = _engine(cfg, files, device, pool)
    else:
        engine.wake_up(["kv_cache"])
    if device.type == "cuda" and not cfg.run.rates_file:
        rates = Rates({**rates.values,
                       **measure_decode_rates(engine, batch=cfg.rollout.max_num_seqs)})
    if cfg.actor.lora.rank and not cfg.memory.param_offload and not cfg.run.rates_file:
        # the adapters are on the card (a shared base keeps them there): time their sync
        rates = Rates({**rates.values, "adapter_tensor_s": measure_adapter_tensor_seconds(
            actor, engine, d2h_in_flight_bytes=optimizer_d2h_bytes(plan.order, actor))})
    return HybridWorker(cfg, actor=actor, ref=ref, engine=engine, pool=pool, meter=meter), rates


def _engine(cfg: Config, files: ModelFiles, device: torch.device, pool: RegionPool) -> Engine:
    lora = cfg.actor.lora
    return Engine(files, cfg.rollout, device=device, dtype=cfg.model.dtype, pool=pool,
                  tp=init_tp_group(cfg.parallel.tp), lora_max_rank=lora.rank or None)


def _shared_base_memory(cfg: Config) -> Config:
    """`cfg` with memory.param_offload off: on a shared base the params part is the
    adapters, which stay on the card (the preflight said so when the config asked for it)."""
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, param_offload=False))
