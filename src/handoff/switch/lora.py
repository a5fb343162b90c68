"""The switch under LoRA (actor.lora.rank > 0): what the worker does differently.

    if cfg.actor.lora.shares_base: engine.sleep_kv()   # the engine's weights: the actor's base
    stats = sync_lora(actor, engine)                       # the adapters, in place

With actor.lora.share_base (plan/order.py's `lora` order) the engine's weights are the
trainer's frozen base: its sleep drops the KV only, the sync copies the adapters in place,
the wake maps the KV. Without (the base held twice: the trainer's own, FSDP-sharded, as a TP
engine needs) the base still never changes, so the engine's sleep backs it up to pinned host
memory (level 1, the source's choice for LoRA) and its wake restores it at the PCIe rate:
the sync copies the adapters only there too (plan/lora.py: BaseCopies, lora_switch_actions).
"""

from __future__ import annotations

from handoff.config import Config
from handoff.rollout.engine import Engine
from handoff.sync.adapters import sync_adapters
from handoff.sync.weights import SyncStats
from handoff.trainer.actor import Actor


def sleep_engine(engine: Engine, cfg: Config) -> None:
    """The switch's engine sleep: KV only on a shared base; under LoRA with a base of the
    trainer's own, the base to pinned host memory and the KV dropped (level 1); in
    full-parameter training weights and KV dropped (level 2): the sync refills them."""
    if cfg.actor.lora.shares_base:
        engine.sleep_kv()
    else:
        engine.sleep(1 if cfg.actor.lora.rank else 2)


def sync_lora(actor: Actor, engine: Engine) -> SyncStats:
    """The adapters into the engine, in place."""
    lora = actor.lora
    return sync_adapters(actor.adapter_tensors(engine.dtype), engine.load_adapter,
                         alpha=lora.alpha, rank=lora.rank, device=engine.device)
