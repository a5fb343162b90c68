"""The ledger: who owns each byte of a card in both phases, and the nine switch actions.

    actions = switch_actions(shape, cfg.parallel, cfg.memory, hw, kv_pool_bytes=pool)
    [(a.name, a.bytes_per_card, a.seconds) for a in actions]

Per card, with n the FSDP sharding group and N the parameter count (bf16 + fp32 Adam):
training holds params 2N/n, grads 2N/n, fp32 master + Adam 12N/n, the reference 2N/n;
generation holds the engine weights 2N/TP, the KV pool, the activation peak, the CUDA graph
pool. The switch moves, per direction: 12N/n (optimizer offload) + 2N/n (param offload) +
2N/n (ref) over pinned PCIe; grads are freed, not moved, unless `grad_offload` (the source's
quick formula 16N/n + 2N/n counts them). Bytes are exact functions of N and the dtype sizes,
so the runtime can assert measured == planned; seconds = bytes / the link's rate. The two
remaps have their own rates (mapping is slower than unmapping and not linear in size): the
KV wake maps the pool (pool / map_bps, plus a zeroing pass for fp8 KV), the engine sleep
unmaps weights and pool ((weights + pool) / unmap_bps); weight_sync_seconds prices the sync.

`SWITCH_ACTIONS` is a contract with the runtime: the hybrid worker times its actions under
exactly these names, and a run's metrics and summary list them in this order (the switch to
generation's moves, then the switch to training's). Where each runs, and whether the step
waits for it, is `plan.order.switch_order`: the one place the switch order is written. An
action whose offload is off stays in the list with 0 bytes and 0 seconds.

Exposed seconds (`exposed_seconds`): the part of each action's own seconds that the step
waits for: all of it, except for the moves the order runs `behind` work (the copies back
behind the forwards before the update, or the update's compute; with an elastic KV pool the
copies to the host behind generation), each exposed only by what it outlasts that work, in
turn with the moves before it behind the same work.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from handoff.config import MemoryConfig, ParallelConfig
from handoff.plan.hardware import GB, HardwareProfile
from handoff.plan.kvpool import engine_weight_bytes
from handoff.plan.order import switch_order
from handoff.plan.shapes import ModelShape

SWITCH_ACTIONS = ("optimizer_d2h", "params_d2h", "ref_d2h", "engine_weights_sync",
                  "kv_cache_wake", "engine_sleep", "params_h2d", "optimizer_h2d", "ref_h2d")
HOST_LINK = "PCIe"


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each kind of state."""

    param_bytes: int = 2       # the trainer's compute params (bf16)
    grad_bytes: int = 2
    master_bytes: int = 4      # fp32 master copy (0 when the params are fp32 themselves)
    optimizer_bytes: int = 8   # Adam's two moments
    engine_bytes: int = 2      # the engine's weights
    kv_bytes: int = 2          # one KV cache element

    @classmethod
    def for_model(cls, dtype: str = "bfloat16", kv_dtype: str = "auto") -> "Dtypes":
        width = 4 if dtype == "float32" else 2
        kv = 1 if kv_dtype == "fp8" else width
        return cls(param_bytes=width, grad_bytes=width, master_bytes=0 if width == 4 else 4,
                   engine_bytes=width, kv_bytes=kv)

    @property
    def train_state_bytes(self) -> int:
        """Bytes per parameter of the full training state (16 for bf16 + fp32 Adam)."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class SwitchAction:
    """One step of the handoff on one card."""

    name: str
    direction: str        # D2H, H2D, D2D, map, unmap
    bytes_per_card: int
    link: str
    seconds: float
    note: str

    @property
    def on_host_link(self) -> bool:
        return self.link == HOST_LINK

    def to_dict(self) -> dict:
        return asdict(self)


def shard_size(parallel: ParallelConfig) -> int:
    return parallel.shard_size or parallel.gpus


def trainer_bytes(shape: ModelShape, shard: int, dtypes: Dtypes, *, ref: bool = True) -> dict:
    """Per-card bytes of each trainer owner (FSDP shards of 1/shard)."""
    n = shape.num_params

    def per_card(width: int) -> int:
        return math.ceil(n * width / shard)

    return {"params": per_card(dtypes.param_bytes), "grads": per_card(dtypes.grad_bytes),
            "optimizer": per_card(dtypes.master_bytes + dtypes.optimizer_bytes),
            "reference": per_card(dtypes.param_bytes) if ref else 0}


def is_in_process(parallel: ParallelConfig, in_process: bool | None = None) -> bool:
    """The sync's transport: in-process (no IPC) by default for a shard group of one."""
    return shard_size(parallel) == 1 if in_process is None else in_process


def weight_sync_seconds(shape: ModelShape, parallel: ParallelConfig, hw: HardwareProfile,
                        dtypes: Dtypes, bucket_bytes: int, *, in_process: bool | None = None,
                        weights_map_bps: float | None = None) -> float:
    """Seconds to push the trainer's full weights into the engine (see is_in_process).

    Both paths all-gather each full tensor over NVLink (nothing with a shard group of one)
    and copy it into a bucket and out of it into the engine's shard (read + write each).
    Gathered over CUDA IPC (the source's engine in its own process): large copies at
    hw.d2d_bps and a fixed overhead per bucket (IPC handle, load_weights, ACK).
    In-process (our worker): no IPC, but the engine's weights region is mapped inside the
    timed action, every tensor costs host work (bucket slot, copy launch, load_weights'
    lookup), and the copies are a kernel per tensor, at hw.sync_copy_bps. Host and device
    overlap (one stream, no wait between buckets): the slower of the two sets the time.
    The weights map at `weights_map_bps` when it was measured at their size (mapping time
    is not linear in size), else at hw.map_bps.
    """
    full = shape.num_params * dtypes.param_bytes
    group = shard_size(parallel)
    gather = full * (group - 1) / group / hw.nvlink_bps
    written = engine_weight_bytes(shape, parallel.tp, dtypes.engine_bytes)
    traffic = 2 * (full + written)  # read + write, into the bucket and out of it
    if not is_in_process(parallel, in_process):
        return (gather + traffic / hw.d2d_bps
                + math.ceil(full / bucket_bytes) * hw.sync_bucket_seconds)
    return (gather + written / (weights_map_bps or hw.map_bps)
            + max(traffic / hw.sync_copy_bps, shape.num_tensors * hw.sync_tensor_seconds))


def switch_actions(shape: ModelShape, parallel: ParallelConfig, memory: MemoryConfig,
                   hw: HardwareProfile, *, kv_pool_bytes: float, dtypes: Dtypes = Dtypes(),
                   ref: bool = True, grad_offload: bool = False,
                   bucket_bytes: int = 512 * 2 ** 20, in_process: bool | None = None,
                   weights_map_bps: float | None = None,
                   h2d_bps: float | None = None, elastic_pool: bool = False,
                   updates_per_step: int = 1) -> list[SwitchAction]:
    """The nine actions of one step's two switches, in SWITCH_ACTIONS order (in_process,
    weights_map_bps: how the sync is priced, see weight_sync_seconds; h2d_bps: the
    host-to-device rate when it differs from hw.pinned_pcie_bps).

    elastic_pool (rollout.kv_pool=elastic) with memory.overlap: the wake maps what is free
    beside the copies to the host still running, the pool less the optimizer's and the
    params' offloaded bytes, and the sleep unmaps that. The pool grows into their memory
    only if generation runs short of blocks (a second map, which the worker records under
    kv_cache_wake too; the ledger cannot know the workload's need, so prices the wake).

    to_train copies the params in right after the engine's sleep, and the ref soon after,
    while the copy engines are busy with the pages the sleep released: those two copies
    are done by a kernel (handoff.memory.host_copy), at hw.kernel_h2d_bps. Streamed
    (memory.overlap) with a ref forward first (a ref, one update per step), the params' copy
    runs on the copy engines under it, at the H2D rate."""
    owners = trainer_bytes(shape, shard_size(parallel), dtypes, ref=ref)
    opt = owners["optimizer"] + (owners["grads"] if grad_offload else 0)
    order = switch_order(memory, ref=ref, elastic_pool=elastic_pool,
                         updates_per_step=updates_per_step)
    opt_on = memory.optimizer_offload
    param_on = memory.param_offload
    ref_on = ref and memory.ref_offload
    ref_copy = order.get("ref_d2h")
    ref_copied = ref_copy is not None and ref_copy.how != "drop"
    pcie = hw.pinned_pcie_bps
    h2d = h2d_bps or pcie
    by_kernel = hw.kernel_h2d_bps or h2d
    params_back = order.get("params_h2d")
    params_rate = by_kernel if params_back is None or params_back.by_kernel else h2d
    seconds = {"params_h2d": owners["params"] / params_rate,
               "ref_h2d": owners["reference"] / by_kernel, "optimizer_h2d": opt / h2d}

    def move(name: str, direction: str, on: bool, nbytes: int, note: str, off_note: str):
        if not on:
            return SwitchAction(name, direction, 0, HOST_LINK, 0.0, off_note)
        return SwitchAction(name, direction, nbytes, HOST_LINK,
                            seconds[name] if direction == "H2D" else nbytes / pcie, note)

    opt_what = "fp32 master + Adam" + (" + grad shard" if grad_offload else "")
    grads_note = "grads move with the optimizer" if grad_offload else "grads are freed, not moved"
    weights = engine_weight_bytes(shape, parallel.tp, dtypes.engine_bytes)
    pool = max(int(kv_pool_bytes), 0)
    # The copies to the host that run under generation still hold their memory at the wake.
    beside = {m.action for m in order.behind("generation")}
    beside_copies = elastic_pool and memory.overlap
    pool = max(pool - (opt if "optimizer_d2h" in beside else 0)
               - (owners["params"] if "params_d2h" in beside else 0), 0)
    full_gb = shape.num_params * dtypes.param_bytes / GB
    gathered = shard_size(parallel) > 1
    local = is_in_process(parallel, in_process)
    sync_link = ("NVLink all-gather + " if gathered else "") + (
        ("in-process copy" if gathered else "in-card copy") if local else "CUDA IPC")
    kv_seconds = pool / hw.map_bps + (pool / hw.d2d_bps if dtypes.kv_bytes == 1 else 0.0)
    no_ref = "no reference model" if not ref else "off: the reference stays on the card"
    ref_down = no_ref if not ref_on else "dropped, not copied: its host copy is unchanged"
    return [
        move("optimizer_d2h", "D2H", opt_on, opt,
             f"{opt_what}; needs {opt / GB:.1f} GB pinned host RAM per card",
             "off: optimizer state stays on the card"),
        move("params_d2h", "D2H", param_on, owners["params"], grads_note,
             "off: bf16 params stay on the card"),
        move("ref_d2h", "D2H", ref_copied, owners["reference"], "", ref_down),
        SwitchAction("engine_weights_sync", "D2D", weights, sync_link,
                     weight_sync_seconds(shape, parallel, hw, dtypes, bucket_bytes,
                                         in_process=in_process,
                                         weights_map_bps=weights_map_bps),
                     f"the whole model ({full_gb:.1f} GB) flows through every card"),
        SwitchAction("kv_cache_wake", "map", pool, "cuMemMap, no copy", kv_seconds,
                     ("beside the copies to the host; " if beside_copies else "")
                     + "prefix cache emptied" + ("; fp8 KV zeroed, scales reset to 1"
                                                 if dtypes.kv_bytes == 1 else "")),
        SwitchAction("engine_sleep", "unmap", 0, "cuMemUnmap", (weights + pool) / hw.unmap_bps,
                     "weights and KV discarded; addresses kept, CUDA graphs not recaptured"),
        move("params_h2d", "H2D", param_on, owners["params"], "before old_log_prob",
             "off: bf16 params stay on the card"),
        move("optimizer_h2d", "H2D", opt_on, opt,
             "back behind the forwards before the update" if memory.overlap
             else "only loaded right before update_actor",
             "off: optimizer state stays on the card"),
        move("ref_h2d", "H2D", ref_on, owners["reference"], "only loaded for the ref forward",
             no_ref),
    ]


def exposed_seconds(seconds: dict[str, float], memory: MemoryConfig, *, compute_seconds: float,
                    forward_seconds: float, generation_seconds: float | None,
                    elastic_pool: bool, ref: bool = True,
                    updates_per_step: int = 1, lora: bool = False) -> dict[str, float]:
    """Each action's seconds the step waits for (the module docstring), from its own
    `seconds` by name. The moves `plan.order` runs behind the first trainer pass hide behind
    the forwards before the update (`forward_seconds` each: the ref's, and the old policy's
    with more updates), or with none behind the update (`compute_seconds`, the trainer's
    whole compute, plan.trainer); those behind generation behind `generation_seconds` (none
    known: all exposed). Moves behind the same work run in turn; `lora`: plan.order's LoRA
    moves."""
    order = switch_order(memory, ref=ref, elastic_pool=elastic_pool,
                         updates_per_step=updates_per_step, lora=lora)
    before_update = forward_seconds * (int(ref) + int(updates_per_step > 1))
    work = {"first_pass": before_update if before_update > 0 else compute_seconds,
            "generation": generation_seconds}
    exposed = dict(seconds)
    for phase, behind in work.items():
        if behind is None:
            continue
        queued = 0.0   # the seconds of the moves queued so far behind this work
        for move in order.behind(phase):
            late_before = max(0.0, queued - behind)
            queued += seconds[move.action]
            exposed[move.action] = max(0.0, queued - behind) - late_before
    return exposed


def switch_summary(actions: list[SwitchAction], step_seconds: float | None = None, *,
                   exposed: dict[str, float] | None = None) -> dict:
    """Totals: host-link bytes (the source's ~130 GB), all seconds, share of the step; with
    `exposed` (exposed_seconds), each action's and their total."""
    total_seconds = sum(a.seconds for a in actions)
    out = {
        "actions": [a.to_dict() for a in actions],
        "total_bytes_per_card": sum(a.bytes_per_card for a in actions if a.on_host_link),
        "host_link_seconds": sum(a.seconds for a in actions if a.on_host_link),
        "total_seconds": total_seconds,
        "share_of_step": total_seconds / step_seconds if step_seconds else None,
    }
    if exposed is not None:
        for a in out["actions"]:
            a["exposed_seconds"] = exposed[a["name"]]
        out["exposed_seconds"] = sum(exposed.values())
    return out


def offloaded_bytes_per_card(actions: list[SwitchAction]) -> int:
    """What one card parks in pinned host RAM: everything that comes back from the host (the
    ref's host copy too, which with memory.overlap is never copied down again)."""
    return sum(a.bytes_per_card for a in actions if a.direction == "H2D")


def memory_by_owner(shape: ModelShape, parallel: ParallelConfig, memory: MemoryConfig,
                    hw: HardwareProfile, *, kv_pool_bytes: float, dtypes: Dtypes = Dtypes(),
                    ref: bool = True) -> dict:
    """Bytes per card per owner in the training and the generation phase."""
    owners = trainer_bytes(shape, shard_size(parallel), dtypes, ref=ref)
    left = ((0 if memory.param_offload else owners["params"])
            + (0 if memory.optimizer_offload else owners["optimizer"])
            + (0 if memory.ref_offload else owners["reference"]))
    return {
        "train": {**owners, "activations": int(hw.train_activation_bytes),
                  "cuda_graph_pool": int(hw.graph_pool_bytes), "resident": int(hw.resident_bytes)},
        "generate": {"engine_weights": engine_weight_bytes(shape, parallel.tp, dtypes.engine_bytes),
                     "kv_pool": int(kv_pool_bytes),
                     "activation_peak": int(hw.activation_peak_bytes),
                     "cuda_graph_pool": int(hw.graph_pool_bytes),
                     "trainer_left": left, "resident": int(hw.resident_bytes)},
    }
