"""The switch under LoRA (actor.lora.rank > 0): what the worker does differently.

    if shares_base(cfg): engine.sleep_kv()        # the engine's weights are the actor's base
    stats = sync_lora(actor, engine, cfg, base_stats=None)

With actor.lora.share_base (plan/order.py's `lora` order) the engine's weights are the
trainer's frozen base: its sleep drops the KV only, the sync copies the adapters in place,
the wake maps the KV. Without (the base held twice), the engine sleeps and reloads the base
as in full-parameter training, then takes the adapters beside it.
"""

from __future__ import annotations

from handoff.config import Config
from handoff.rollout.engine import Engine
from handoff.sync.adapters import sync_adapters
from handoff.sync.weights import SyncStats, WeightIter
from handoff.trainer.actor import Actor


def shares_base(cfg: Config) -> bool:
    """LoRA with the engine's weights as the trainer's base (plan.order's `lora` order)."""
    return bool(cfg.actor.lora.rank) and cfg.actor.lora.share_base


def sleep_engine(engine: Engine, cfg: Config) -> None:
    """The switch's engine sleep: KV only on a shared base, else weights and KV (level 2)."""
    if shares_base(cfg):
        engine.sleep_kv()
    else:
        engine.sleep(2)


def weights_to_send(actor: Actor, engine: Engine) -> WeightIter:
    """What a full sync sends: every parameter, or under LoRA (share_base=false) the base's
    under their HF names (the adapters follow through `add_adapters`)."""
    if actor.lora is None:
        return actor.full_params(engine.dtype)
    return actor.base_tensors(engine.dtype)


def sync_lora(actor: Actor, engine: Engine, base: SyncStats | None = None) -> SyncStats:
    """The adapters into the engine (in place); with `base` (the base's sync just run), one
    record of both."""
    lora = actor.lora
    stats = sync_adapters(actor.adapter_tensors(engine.dtype), engine.load_adapter,
                          alpha=lora.alpha, rank=lora.rank, device=engine.device)
    if base is None:
        return stats
    base.num_tensors += stats.num_tensors
    base.bytes += stats.bytes
    base.seconds += stats.seconds
    base.host_seconds += stats.host_seconds
    return base
