"""Weight sync: the trainer's full tensors -> fixed-size buckets -> the engine's load_weights.

    stats = sync_weights(actor.full_params(dtype), engine.load_weights,
                         bucket_bytes=512 << 20, device=device, readback=engine.export_weight)

The trainer yields (HF name, full tensor) one at a time; tensors are packed into a flat
bucket of `bucket_bytes` and handed over as views when the bucket is full. Two bucket
buffers are allocated once and alternate, so the peak extra memory is two buckets plus one
full parameter whatever the model size (a tensor larger than a bucket goes alone, as
itself). The transport here is in-process (trainer and engine share the process and the
device); the engine copies out of the views into its own layout before the bucket is reused.

With `readback` (HF name -> the engine's copy of that tensor), a checksum of every bucket
is computed on both sides and compared: proof that the engine holds exactly the trainer's
weights. A tensor-parallel engine rank keeps only its shard of each full tensor: `select`
cuts the same shard out of the sent tensor, so each rank checks exactly what it holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from handoff.errors import HandoffError

WeightIter = Iterable[tuple[str, torch.Tensor]]

@dataclass
class SyncStats:
    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0            # until every copy has run (the device's end)
    host_seconds: float = 0.0       # until the last bucket was handed over (the host's end)
    bound_extra_bytes: int = 0      # two bucket buffers + the largest full tensor seen
    measured_peak_extra_bytes: int | None = None   # CUDA: allocator peak over the start
    max_tensor_bytes: int = 0
    verified_buckets: int = 0
    checksums: list[int] = field(default_factory=list)


def checksum(t: torch.Tensor) -> int:
    """Order-sensitive exact checksum of a tensor's bytes (int64 arithmetic, any device)."""
    flat = t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
    if flat.numel() == 0:
        return 0
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    return int((flat * weights).sum().item()) + 31 * flat.numel()


class _Bucket:
    """A flat byte buffer filled with tensors back to back (16-byte aligned)."""

    def __init__(self, num_bytes: int, device: torch.device):
        self.buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self.typed: dict[torch.dtype, torch.Tensor] = {}   # the buffer viewed as each dtype
        self.offset = 0
        self.entries: list[tuple[str, torch.Tensor]] = []

    def fits(self, nbytes: int) -> bool:
        return self.offset + nbytes <= self.buffer.numel()

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        typed = self.typed.get(t.dtype)
        if typed is None:
            whole = self.buffer.numel() // t.element_size() * t.element_size()
            typed = self.typed[t.dtype] = self.buffer[:whole].view(t.dtype)
        # One as_strided, not slice + two views: the host work per tensor is the sync's cost.
        strides, step = [], 1
        for size in reversed(t.shape):
            strides.append(step)
            step *= size
        dst = typed.as_strided(t.shape, strides[::-1], self.offset // t.element_size())
        # A kernel, where copy_ would take the copy engines (cudaMemcpyAsync), which carry
        # the optimizer's offload while the sync runs.
        torch._foreach_copy_([dst], [t])
        self.entries.append((name, dst))
        self.offset += (nbytes + 15) // 16 * 16

    def reset(self) -> None:
        self.offset = 0
        self.entries = []


def _bucket_checksum(entries: list[tuple[str, torch.Tensor]]) -> int:
    total = 0
    for i, (_, t) in enumerate(entries):
        total = (total * 1_000_003 + checksum(t) + i) % (1 << 61)
    return total


def kept_bytes(shapes: Iterable[tuple[str, torch.Size]], dtype: torch.dtype,
               select: Callable[[str, torch.Tensor], torch.Tensor]) -> int:
    """Bytes the engine keeps of full tensors of these (HF name, shape)s: under TP each rank
    its shard, cut by `select` from a meta tensor (nothing allocated). A sync's layout is
    fixed, so a caller counts this once instead of per tensor in the sync's loop."""
    return sum(select(name, torch.empty(shape, dtype=dtype, device="meta")).nbytes
               for name, shape in shapes)


def sync_weights(params: WeightIter, load_weights: Callable[[WeightIter], None], *,
                 bucket_bytes: int, device: torch.device | str,
                 readback: Callable[[str], torch.Tensor] | None = None,
                 select: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> SyncStats:
    """Stream `params` into `load_weights` bucket by bucket; returns what moved and how fast.

    `select(name, full)` is the part of a sent tensor the engine keeps (its TP shard), which
    is what `readback(name)` must equal; by default the whole tensor."""
    if bucket_bytes <= 0:
        raise HandoffError(f"sync bucket size {bucket_bytes} bytes must be positive: "
                           "set sync.bucket_mb to e.g. 512")
    device = torch.device(device)
    stats = SyncStats()
    current = 0
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # not the copy streams
        base_allocated = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    buckets = [_Bucket(bucket_bytes, device), _Bucket(bucket_bytes, device)]
    start = time.perf_counter()

    def flush(entries: list[tuple[str, torch.Tensor]]) -> None:
        if not entries:
            return
        sent = None
        if readback is not None:
            sent = _bucket_checksum([(n, select(n, t)) for n, t in entries] if select else entries)
        load_weights(entries)
        stats.num_buckets += 1
        if readback is not None:
            got = _bucket_checksum([(n, readback(n)) for n, _ in entries])
            if got != sent:
                names = ", ".join(n for n, _ in entries[:4])
                raise HandoffError(f"weight sync checksum mismatch in bucket {stats.num_buckets} "
                                   f"({names}...): the engine does not hold the trainer's weights; "
                                   "check the engine's load_weights name mapping")
            stats.verified_buckets += 1
            stats.checksums.append(sent)

    for name, tensor in params:
        nbytes = tensor.numel() * tensor.element_size()
        stats.num_tensors += 1
        stats.bytes += nbytes
        stats.max_tensor_bytes = max(stats.max_tensor_bytes, nbytes)
        if tensor.device != device:
            tensor = tensor.to(device)
        if nbytes > bucket_bytes:
            # Too big for a bucket: hand the full tensor over as it is.
            flush(buckets[current].entries)
            buckets[current].reset()
            flush([(name, tensor)])
            continue
        if not buckets[current].fits(nbytes):
            flush(buckets[current].entries)
            buckets[current].reset()
            current = 1 - current
        buckets[current].add(name, tensor)
    flush(buckets[current].entries)
    stats.host_seconds = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # not the copy streams
        stats.measured_peak_extra_bytes = torch.cuda.max_memory_allocated(device) - base_allocated
    stats.seconds = time.perf_counter() - start
    stats.bound_extra_bytes = 2 * bucket_bytes + stats.max_tensor_bytes
    return stats

