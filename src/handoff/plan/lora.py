"""LoRA on one copy of the base, in bytes: the adapters' size, memory by owner, the switch.

    n = adapter_params(shape, rank=16, targets=cfg.actor.lora.target_modules)
    bases = BaseCopies.of_run(shape, cfg.actor.lora, memory, cfg.parallel)
    owners = lora_memory_by_owner(shape, memory, hw, adapters=n, kv_pool_bytes=pool, bases=bases)
    actions = lora_switch_actions(shape, memory, hw, rank=16, targets=..., kv_pool_bytes=pool)

Under LoRA the base never changes, so one set of tensors per card is the engine's weights, the
trainer's frozen base and the reference (the actor with its adapters disabled): with
actor.lora.share_base (the default) the base is counted once, whole on each card (2N: an
engine of TP 1), in the engine's weights region, and is never offloaded, synced or copied for
a reference (held twice: the last paragraph). What trains is the adapters: a targeted
Linear of in x out gets A (rank x in) and B (out x rank), rank x (in + out) parameters, on
every decoder layer. Each card holds the adapters whole (data-parallel replicas reduce their
grads): bf16 params and grads and fp32 master + Adam, 16 B per adapter parameter; the engine
holds its own bf16 copy, which the sync overwrites in place.

The switch (plan.order's `lora` moves, the nine SWITCH_ACTIONS names kept): the sleep unmaps
the KV pool only, the weight sync copies the adapters (2 B each, a copy per tensor), the wake
maps the KV pool; the adapters' optimizer state goes to the host and back only when
memory.optimizer_offload is on; params and reference move nothing.

With a base of the trainer's own (actor.lora.share_base=false: the base held twice, as a TP
engine needs; BaseCopies says where each copy is) the trainer keeps its frozen base (N x the
param bytes / its shard), which memory.param_offload moves to the host and back like
full-parameter params; the engine's sleep backs its unchanging base up to pinned host memory
(level 1) and the sync restores it at the PCIe rate, then copies the adapters only.
"""

from __future__ import annotations

import dataclasses
import math

from handoff.config import LORA_TARGETS, LoraConfig, MemoryConfig, ParallelConfig
from handoff.errors import HandoffError
from handoff.plan.hardware import GB, HardwareProfile
from handoff.plan.kvpool import engine_weight_bytes
from handoff.plan.ledger import HOST_LINK, Dtypes, SwitchAction, shard_size
from handoff.plan.order import switch_order
from handoff.plan.shapes import ModelShape


def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear of a dense decoder layer, by its HF name."""
    if shape.num_experts or shape.kv_latent_dim or not shape.intermediate_size:
        raise HandoffError(f"LoRA is planned for dense decoders (q/k/v/o, gate/up/down "
                           f"projections); {shape.name} is a mixture-of-experts, latent-attention "
                           "or MLP-less shape: plan it without --lora-rank")
    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return shapes


def adapter_params(shape: ModelShape, rank: int, targets: list[str] | tuple[str, ...]) -> int:
    """Parameters of the adapters: rank x (in + out) per targeted Linear, on every layer."""
    shapes = projection_shapes(shape)
    return shape.num_layers * sum(rank * sum(shapes[t]) for t in dict.fromkeys(targets))


def adapter_tensors(shape: ModelShape, targets: list[str] | tuple[str, ...]) -> int:
    """Tensors the sync copies: A and B of each targeted Linear, on every layer."""
    return 2 * shape.num_layers * len(dict.fromkeys(targets))


def engine_adapter_rows(shape: ModelShape, rank: int, tp: int) -> int:
    """Elements of LoRA A the engine keeps beside its weights, in their region (rollout.layers.
    adapter_rows): `rank` rows of each decoder linear's input, for all seven projections
    whatever the targets; not where the product adds a bias (Qwen2's q/k/v, Llama's with
    attention_bias or mlp_bias), nor o's and down's under TP."""
    shapes = projection_shapes(shape)
    row_parallel_ok = tp == 1
    names = ((["q_proj", "k_proj", "v_proj"] if not shape.qkv_bias else [])
             + (["o_proj"] if row_parallel_ok and not shape.o_bias else [])
             + (["gate_proj", "up_proj"] if not shape.mlp_bias else [])
             + (["down_proj"] if row_parallel_ok and not shape.mlp_bias else []))
    return shape.num_layers * rank * sum(shapes[n][0] for n in names)


def base_bytes(shape: ModelShape, dtypes: Dtypes) -> int:
    """The base on each card, whole: the engine's weights and the trainer's frozen base."""
    return shape.num_params * dtypes.engine_bytes


@dataclasses.dataclass(frozen=True)
class BaseCopies:
    """Where a LoRA run's base is, in bytes per card."""

    shared: bool            # one copy: the engine's weights are the trainer's frozen base
    trainer: int            # the trainer's base through the update
    engine: int             # the engine's weights (held twice: with the adapters' A rows)
    kept_generating: int    # the trainer's own base left on the card while the engine runs
    engine_adapters: int = 0   # the engine's adapter buffers not counted in `engine`

    @classmethod
    def of(cls, shape: ModelShape, *, shares_base: bool, shard: int, tp: int,
           param_offload: bool, dtypes: Dtypes = Dtypes(), rank: int = 0) -> "BaseCopies":
        """`rank`: the engine's adapter rank. Its buffers are A and B of all seven projections
        (the engine sizes a slot for every decoder linear, whatever the targets:
        rollout/lora.py); held twice, the engine's sleep moves the A rows beside its weights
        with them (one region), so they count with the weights, not the adapters."""
        slots = adapter_params(shape, rank, LORA_TARGETS) * dtypes.engine_bytes if rank else 0
        if shares_base:
            whole = base_bytes(shape, dtypes)
            return cls(shared=True, trainer=whole, engine=whole, kept_generating=0,
                       engine_adapters=slots)
        trainer = math.ceil(shape.num_params * dtypes.param_bytes / shard)
        rows = engine_adapter_rows(shape, rank, tp) * dtypes.engine_bytes if rank else 0
        return cls(shared=False, trainer=trainer,
                   engine=engine_weight_bytes(shape, tp, dtypes.engine_bytes) + rows,
                   kept_generating=0 if param_offload else trainer,
                   engine_adapters=slots - rows)

    @classmethod
    def of_run(cls, shape: ModelShape, lora: LoraConfig, memory: MemoryConfig,
               parallel: ParallelConfig, dtypes: Dtypes = Dtypes()) -> "BaseCopies":
        """The copies of a run's config (actor.lora, memory, parallel)."""
        return cls.of(shape, shares_base=lora.shares_base, shard=shard_size(parallel),
                      tp=parallel.tp, param_offload=memory.param_offload, dtypes=dtypes,
                      rank=lora.rank)

    @classmethod
    def shared_of(cls, shape: ModelShape, dtypes: Dtypes = Dtypes()) -> "BaseCopies":
        return cls.of(shape, shares_base=True, shard=1, tp=1, param_offload=False,
                      dtypes=dtypes)


def adapter_state_bytes(adapters: int, dtypes: Dtypes) -> dict[str, int]:
    """The trainer's adapter state per card: params, grads, fp32 master + Adam."""
    return {"adapter_params": adapters * dtypes.param_bytes,
            "adapter_grads": adapters * dtypes.grad_bytes,
            "adapter_optimizer": adapters * (dtypes.master_bytes + dtypes.optimizer_bytes)}


def lora_trainer_left_bytes(adapters: int, memory: MemoryConfig, dtypes: Dtypes,
                            bases: BaseCopies | None = None) -> int:
    """Trainer state on the card during generation: the adapters' params, their optimizer
    state unless offloaded (grads are freed), and a base of its own unless offloaded."""
    state = adapter_state_bytes(adapters, dtypes)
    return (state["adapter_params"] + (0 if memory.optimizer_offload
                                       else state["adapter_optimizer"])
            + (bases.kept_generating if bases else 0))


def lora_memory_by_owner(shape: ModelShape, memory: MemoryConfig, hw: HardwareProfile, *,
                         adapters: int, kv_pool_bytes: float, bases: BaseCopies,
                         dtypes: Dtypes = Dtypes()) -> dict:
    """Bytes per card per owner in both phases: the base (shared: once, no reference, no
    trainer copy; held twice: the trainer's through the update, the engine's while it runs,
    the trainer's too unless offloaded), the adapters' state, the engine's adapters."""
    return {
        "train": {"base": bases.trainer, **adapter_state_bytes(adapters, dtypes),
                  "activations": int(hw.train_activation_bytes),
                  "cuda_graph_pool": int(hw.graph_pool_bytes), "resident": int(hw.resident_bytes)},
        "generate": {"base": bases.engine, "engine_adapters": bases.engine_adapters,
                     "kv_pool": int(kv_pool_bytes),
                     "activation_peak": int(hw.activation_peak_bytes),
                     "cuda_graph_pool": int(hw.graph_pool_bytes),
                     "trainer_left": lora_trainer_left_bytes(adapters, memory, dtypes, bases),
                     "resident": int(hw.resident_bytes)},
    }


def adapter_sync_seconds(shape: ModelShape, hw: HardwareProfile, *, rank: int,
                         targets: list[str] | tuple[str, ...], dtypes: Dtypes) -> float:
    """The adapters copied in the card into the engine's (read + write), a copy per tensor:
    no gather (every card holds them whole), no map (the engine's adapters stay mapped)."""
    nbytes = adapter_params(shape, rank, targets) * dtypes.param_bytes
    per_tensor = hw.adapter_tensor_seconds or hw.sync_tensor_seconds
    return max(2 * nbytes / hw.sync_copy_bps, adapter_tensors(shape, targets) * per_tensor)


def lora_switch_actions(shape: ModelShape, memory: MemoryConfig, hw: HardwareProfile, *,
                        rank: int, targets: list[str] | tuple[str, ...], kv_pool_bytes: float,
                        dtypes: Dtypes = Dtypes(), grad_offload: bool = False,
                        elastic_pool: bool = False, bases: BaseCopies | None = None,
                        h2d_bps: float | None = None) -> list[SwitchAction]:
    """The nine actions of one LoRA step's two switches, in SWITCH_ACTIONS order (module
    docstring); an elastic pool maps beside the adapters' optimizer copy to the host when
    plan.order runs it under generation. `bases`: a base held twice (None: shared);
    `h2d_bps`: the rate that restores the engine's base (None: the profile's PCIe)."""
    bases = bases or BaseCopies.shared_of(shape, dtypes)
    adapters = adapter_params(shape, rank, targets)
    state = adapter_state_bytes(adapters, dtypes)
    opt = state["adapter_optimizer"] + (state["adapter_grads"] if grad_offload else 0)
    order = switch_order(memory, ref=False, elastic_pool=elastic_pool, lora=bases.shared)
    under_generation = {m.action for m in order.behind("generation")}
    # Held twice, memory.param_offload moves the trainer's own base and the adapters.
    params = (0 if bases.shared or not memory.param_offload
              else bases.trainer + state["adapter_params"])
    pool = max(int(kv_pool_bytes), 0)
    # An elastic pool maps at its wake what the copies to the host under generation still
    # hold back (they free their memory as they land).
    pool = max(pool - (opt if "optimizer_d2h" in under_generation else 0)
               - (params if "params_d2h" in under_generation else 0), 0)
    sync_bytes = adapters * dtypes.engine_bytes
    base_gb = base_bytes(shape, dtypes) / GB
    kv_seconds = pool / hw.map_bps + (pool / hw.d2d_bps if dtypes.kv_bytes == 1 else 0.0)
    h2d = hw.pinned_pcie_bps
    opt_on = memory.optimizer_offload

    def nothing(name: str, direction: str, why: str) -> SwitchAction:
        return SwitchAction(name, direction, 0, HOST_LINK, 0.0, why)

    def optimizer(name: str, direction: str, note: str) -> SwitchAction:
        if not opt_on:
            return nothing(name, direction, "off: the adapters' optimizer state stays on the card")
        return SwitchAction(name, direction, opt, HOST_LINK, opt / h2d, note)

    kept = f"LoRA: the base ({base_gb:.1f} GB) is the engine's weights, never moved"
    no_ref = "LoRA: the reference is the base with the adapters off, no copy"
    adam = "the adapters' fp32 master + Adam" + (" + grads" if grad_offload else "")
    actions = [
        optimizer("optimizer_d2h", "D2H", adam),
        nothing("params_d2h", "D2H", kept),
        nothing("ref_d2h", "D2H", no_ref),
        SwitchAction("engine_weights_sync", "D2D", sync_bytes, "in-card copy",
                     adapter_sync_seconds(shape, hw, rank=rank, targets=targets, dtypes=dtypes),
                     f"the adapters only ({adapter_tensors(shape, targets)} tensors), in place"),
        SwitchAction("kv_cache_wake", "map", pool, "cuMemMap, no copy", kv_seconds,
                     ("beside the optimizer's copy to the host; " if under_generation else "")
                     + "prefix cache emptied"),
        SwitchAction("engine_sleep", "unmap", 0, "cuMemUnmap", pool / hw.unmap_bps,
                     "KV discarded only: the weights stay mapped, they are the trainer's base"),
        nothing("params_h2d", "H2D", kept),
        optimizer("optimizer_h2d", "H2D", adam + (", back behind the forwards before the update"
                                                  if memory.overlap else ", before the update")),
        nothing("ref_h2d", "H2D", no_ref),
    ]
    if bases.shared:
        return actions
    # Held twice: the trainer's own base moves as full-parameter params do; the engine's is
    # backed up to the host at its sleep (level 1) and restored before the adapters' sync.
    engine_gb = bases.engine / GB
    back = h2d_bps or h2d

    def trainer_base(name: str, direction: str, bps: float) -> SwitchAction:
        if not params:
            return nothing(name, direction, "off: the trainer's own base stays on the card")
        return SwitchAction(name, direction, params, HOST_LINK, params / bps,
                            "the trainer's own base (frozen) and the adapters")

    changed = {
        "params_d2h": trainer_base("params_d2h", "D2H", h2d),
        "params_h2d": trainer_base("params_h2d", "H2D", back),
        "engine_sleep": SwitchAction(
            "engine_sleep", "D2H", bases.engine, HOST_LINK,
            bases.engine / h2d + (bases.engine + pool) / hw.unmap_bps,
            f"level 1: the engine's base ({engine_gb:.1f} GB, never changed) to pinned host "
            "and unmapped, KV discarded"),
        "engine_weights_sync": SwitchAction(
            "engine_weights_sync", "H2D", bases.engine + sync_bytes, HOST_LINK,
            bases.engine / hw.map_bps + bases.engine / back
            + adapter_sync_seconds(shape, hw, rank=rank, targets=targets, dtypes=dtypes),
            "the engine's base mapped and restored from pinned host, then the adapters "
            "only, in place"),
    }
    return [changed.get(a.name, a) for a in actions]
