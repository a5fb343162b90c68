"""GPU and link profiles for the cost model: HBM, pinned PCIe, NVLink, decode bandwidth.

    hw = hardware_profile("h100-sxm", HardwareConfig(pinned_pcie_gbps=40))

Every number is a profile parameter, never a constant of the formulas, and every one can be
overridden from the config (`hardware.*`) or the `handoff plan` flags. Units inside the plan
are SI: bytes, bytes per second, seconds (1 GB = 1e9 bytes, as the source's tables count).

Where the numbers come from:
* h100-sxm: the source's assumptions (80 GB, pinned PCIe 25 GB/s measured, NVLink 450 GB/s
  per direction); its 8B utilization table implies a ~2 GB activation peak, ~2.0 TB/s
  effective decode bandwidth and ~6 GB that even an exclusive card never gives the engine.
* h200: measured on this project's device (139 GiB usable HBM, pinned 55 GB/s each way,
  101 GB/s both directions at once, device copy 4.2 TB/s read + write); torch_memory_saver
  unmaps at ~2 TB/s at every size (8 GiB 4.2 ms, 100 GiB 58 ms) but maps in a time that is
  not linear in size (8 GiB 0.5 ms; 100-112 GiB anywhere from 4 to 355 ms): map_bps is the 4B
  run's 108 GiB KV wake (79 ms), and a run measures both rates at its own KV pool's size
  (handoff.calibrate); ~40 us of host work per tensor of an in-process weight sync
  (Qwen3-1.7B: 310 tensors, 3.2 GB in 30 ms); a kernel copies host-to-device at 51 GB/s
  (also right after a 100 GiB sleep, when the copy engines manage 27 GB/s); decode
  bandwidth scaled from the H100's 60% of peak.
* a100-80g: PCIe Gen4 and NVLink3 figures, decode bandwidth at 60% of the 2.0 TB/s peak.
* cpu: the CPU demo, where "HBM" is host memory and every link is a memcpy.
* train_flops_per_s (the trainer's model FLOP/s per card): h200 from the 4B colocated step of
  2026-12-04 (packed micro-batches, eager layers: 2.65e15 model FLOPs in 8.35 s of ref
  forward + update, 317 TFLOP/s; `handoff bench train-compute` gave 311 on the same shape,
  408 with actor.compile); h100-sxm assumed equal (the same GH100 compute); a100-80g scaled by
  the bf16 matmul peaks (312 / 989); cpu a round figure near the CPU demo's (2026-12-03,
  2-core box shared with other jobs: ~6 N T of ~1.4K tokens in a ~43 s update, ~26 GFLOP/s,
  switch moves included). Measure yours with `handoff bench train-compute` and pass
  --train-tflops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from handoff.config import HardwareConfig
from handoff.errors import HandoffError

GB = 1e9
GIB = 2 ** 30
CPU_TRAIN_FLOPS = 20e9


@dataclass(frozen=True)
class HardwareProfile:
    """One card and its links, in bytes and seconds."""

    name: str
    hbm_bytes: float               # HBM per card the allocators can use
    pinned_pcie_bps: float         # pinned host<->device copy rate, per direction
    nvlink_bps: float              # per card, per direction (the all-gather of weight sync)
    decode_bw_bps: float           # effective HBM bandwidth of a decode step
    d2d_bps: float                 # device copy rate, bytes read + written per second
    sync_copy_bps: float           # an in-process weight sync's copies (a kernel per tensor)
    map_bps: float                 # cuMemMap of a sleeping region (wake), bytes per second
    unmap_bps: float               # cuMemUnmap of an awake region (sleep), bytes per second
    activation_peak_bytes: float   # engine activation peak (profiled)
    graph_pool_bytes: float        # engine CUDA graph pool (resident)
    resident_bytes: float          # CUDA contexts, NCCL buffers, allocator residue: nobody's
    train_activation_bytes: float  # trainer activation peak per card (after recompute)
    sync_bucket_seconds: float     # per weight-sync bucket over CUDA IPC: open, load, ACK
    sync_tensor_seconds: float     # host work per tensor of an in-process weight sync
    host_ram_bytes: float          # host RAM per node
    gpus_per_node: int
    # Host-to-device by a kernel (handoff.memory.host_copy), as to_train copies right after
    # the engine's sleep, when the copy engines are busy; 0: at pinned_pcie_bps.
    kernel_h2d_bps: float = 0.0
    # Model FLOP/s the trainer reaches per card (handoff.plan.trainer: 6N T actor + 2N T ref
    # over its compute seconds); prices the training part of the step when none is given.
    train_flops_per_s: float = 315e12
    # A decode step's fixed part (weights read, launches, sampling, the host's turn) and
    # what each running sequence adds beyond its KV reads; measured by the engine at start
    # (calibrate.measure_decode_rates). 0: weights / decode_bw_bps alone.
    decode_floor_s: float = 0.0
    decode_per_seq_s: float = 0.0
    # The paged decode kernel's KV read rate (`handoff bench kernel`, docs/PERF.md: the H200
    # measured; other cards at the H200's share of HBM peak, 90%). 0: decode_bw_bps.
    kv_read_bps: float = 0.0
    # Host work per tensor of the LoRA sync's load into the engine's adapter buffers (names
    # checked, views taken, batched copies: rollout/lora.py); measured at the start of a LoRA
    # run (calibrate.measure_adapter_tensor_seconds). 0: sync_tensor_seconds, a full sync's.
    # The H100's: the 14B's sync, its writes replayed from one graph, 4.3 ms for 560 tensors
    # (2026-12-07, docs/PERF.md); the other cards' are not measured with the graph yet.
    adapter_tensor_seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PROFILES: dict[str, HardwareProfile] = {
    "h100-sxm": HardwareProfile(
        name="h100-sxm", hbm_bytes=80 * GB, pinned_pcie_bps=25 * GB, nvlink_bps=450 * GB,
        decode_bw_bps=2000 * GB, d2d_bps=2800 * GB, sync_copy_bps=1700 * GB,
        map_bps=300 * GB, unmap_bps=300 * GB,
        activation_peak_bytes=2 * GB, graph_pool_bytes=0.5 * GB, resident_bytes=6 * GB,
        train_activation_bytes=4 * GB, sync_bucket_seconds=0.006, sync_tensor_seconds=40e-6,
        host_ram_bytes=2048 * GB, gpus_per_node=8, train_flops_per_s=315e12,
        kv_read_bps=0.9 * 3350 * GB, adapter_tensor_seconds=7.7e-6),
    "h200": HardwareProfile(
        name="h200", hbm_bytes=139 * GIB, pinned_pcie_bps=55 * GB, nvlink_bps=450 * GB,
        decode_bw_bps=2900 * GB, d2d_bps=4200 * GB, sync_copy_bps=2500 * GB,
        map_bps=1500 * GB, unmap_bps=2000 * GB,
        activation_peak_bytes=2 * GB, graph_pool_bytes=0.5 * GB, resident_bytes=6 * GB,
        train_activation_bytes=4 * GB, sync_bucket_seconds=0.006, sync_tensor_seconds=25e-6,
        host_ram_bytes=2048 * GB, gpus_per_node=8, kernel_h2d_bps=51 * GB,
        train_flops_per_s=315e12, kv_read_bps=4300 * GB),
    "a100-80g": HardwareProfile(
        name="a100-80g", hbm_bytes=80 * GB, pinned_pcie_bps=20 * GB, nvlink_bps=300 * GB,
        decode_bw_bps=1200 * GB, d2d_bps=1700 * GB, sync_copy_bps=1000 * GB,
        map_bps=300 * GB, unmap_bps=300 * GB,
        activation_peak_bytes=2 * GB, graph_pool_bytes=0.5 * GB, resident_bytes=6 * GB,
        train_activation_bytes=4 * GB, sync_bucket_seconds=0.006, sync_tensor_seconds=40e-6,
        host_ram_bytes=1024 * GB, gpus_per_node=8, train_flops_per_s=99e12,
        kv_read_bps=0.9 * 2039 * GB),
    "cpu": HardwareProfile(
        name="cpu", hbm_bytes=16 * GB, pinned_pcie_bps=5 * GB, nvlink_bps=5 * GB,
        decode_bw_bps=20 * GB, d2d_bps=10 * GB, sync_copy_bps=10 * GB,
        map_bps=50 * GB, unmap_bps=50 * GB,
        activation_peak_bytes=0.25 * GB, graph_pool_bytes=0.0, resident_bytes=0.5 * GB,
        train_activation_bytes=0.5 * GB, sync_bucket_seconds=0.001, sync_tensor_seconds=20e-6,
        host_ram_bytes=32 * GB, gpus_per_node=1, train_flops_per_s=CPU_TRAIN_FLOPS),
}

# config field -> (profile field, factor from the config's unit to SI)
_OVERRIDES = {
    "hbm_gb": ("hbm_bytes", GB),
    "pinned_pcie_gbps": ("pinned_pcie_bps", GB),
    "nvlink_gbps": ("nvlink_bps", GB),
    "decode_bw_tbps": ("decode_bw_bps", 1e12),
    "d2d_gbps": ("d2d_bps", GB),
    "sync_copy_gbps": ("sync_copy_bps", GB),
    "map_gbps": ("map_bps", GB),
    "unmap_gbps": ("unmap_bps", GB),
    "activation_peak_gb": ("activation_peak_bytes", GB),
    "graph_pool_gb": ("graph_pool_bytes", GB),
    "resident_gb": ("resident_bytes", GB),
    "train_activation_gb": ("train_activation_bytes", GB),
    "sync_bucket_ms": ("sync_bucket_seconds", 1e-3),
    "sync_tensor_us": ("sync_tensor_seconds", 1e-6),
    "host_ram_gb": ("host_ram_bytes", GB),
    "train_tflops": ("train_flops_per_s", 1e12),
}


def hardware_profile(name: str, overrides: HardwareConfig | None = None) -> HardwareProfile:
    """The named profile with every non-None field of `overrides` applied."""
    if name not in PROFILES:
        raise HandoffError(f"unknown hardware {name!r}: choose one of {', '.join(PROFILES)} "
                           "and override its rates with --pcie-gbps, --hbm-gb, ...")
    hw = PROFILES[name]
    if overrides is None:
        return hw
    changes: dict = {}
    for key, (field_name, unit) in _OVERRIDES.items():
        value = getattr(overrides, key, None)
        if value is not None:
            changes[field_name] = float(value) * unit
    if overrides.gpus_per_node is not None:
        changes["gpus_per_node"] = int(overrides.gpus_per_node)
    hw = dataclasses.replace(hw, **changes)
    if hw.resident_bytes >= hw.hbm_bytes:   # nothing left for anyone: a typo, not a plan
        raise HandoffError(f"hardware.resident_gb={hw.resident_bytes / GB:g} (--resident-gb) "
                           f"fills the card's {hw.hbm_bytes / GB:g} GB of HBM: it is what no "
                           "owner can use (CUDA contexts, NCCL); a few GB, e.g. 6")
    return hw
