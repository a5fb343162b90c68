"""Process group and device mesh for the trainer: one process per device, 1-D FSDP mesh.

    mesh = init_mesh("cuda")     # torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; NCCL (+ gloo for CPU)
    mesh = init_mesh("cpu")      # gloo; without torchrun a 1-process group is created in memory

An existing process group (the hybrid worker may have made one) is reused as it is.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from handoff.errors import HandoffError


def resolve_device(device: str | torch.device) -> torch.device:
    """'cpu' | 'cuda' | 'cuda:1' | 'auto' -> a concrete device (cuda -> this process's LOCAL_RANK)."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise HandoffError(f"device {str(device)!r} is not a device name: use cpu or cuda") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise HandoffError("device 'cuda' was asked for but torch sees no GPU: "
                               "pass --device cpu (or run.device=cpu)")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise HandoffError(f"device {str(device)!r} is not supported: use cpu or cuda")
    return device


def init_process_group(device: torch.device) -> None:
    """Join the torchrun group (env://), or make a 1-process group when launched alone."""
    if dist.is_initialized():
        return
    # With a GPU present the group gets NCCL too, even when a CPU model creates it first: a
    # CUDA model in the same process (tests, benches) then finds the backend it needs.
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def init_mesh(device: str | torch.device) -> DeviceMesh:
    """The 1-D mesh over every process of the default group, on `device`'s type."""
    dev = resolve_device(device)
    init_process_group(dev)
    return init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the default group (a no-op copy-free call at world size 1)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t
