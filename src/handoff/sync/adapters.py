"""The LoRA sync: the actor's adapter tensors copied into the engine's adapter buffers in place.

    stats = sync_adapters(actor.adapter_tensors(engine.dtype), engine.load_adapter,
                          alpha=16, rank=8, device=device)

Megabytes, no buckets: the engine's `load_adapter` checks every tensor (a later load of the
same names and shapes reuses those checks), then copies them in batches into its fixed
buffers (each TP rank its part). The engine folds alpha / rank into A
as it copies, so its buffers are not the sent tensors and sync.verify's readback does not
apply here (rollout/lora.py's tests check the copy against peft's outputs).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from handoff.sync.weights import SyncStats, WeightIter


def sync_adapters(tensors: WeightIter, load_adapter: Callable[..., None], *, alpha: float,
                  rank: int, device: torch.device | str) -> SyncStats:
    """Hand (peft name, whole tensor) pairs to `load_adapter`; returns what moved and how fast
    (seconds: until the copies ran on the device)."""
    device = torch.device(device)
    stats = SyncStats(num_buckets=1)
    start = time.perf_counter()

    def counted() -> WeightIter:
        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            stats.num_tensors += 1
            stats.bytes += nbytes
            stats.max_tensor_bytes = max(stats.max_tensor_bytes, nbytes)
            yield name, tensor.to(device)

    load_adapter(counted(), alpha=alpha, rank=rank)
    stats.host_seconds = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    stats.seconds = time.perf_counter() - start
    stats.bound_extra_bytes = stats.bytes   # load_adapter holds every tensor until it copies
    return stats
