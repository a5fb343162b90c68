"""Tensor parallelism for the rollout engine: the TP group, its collectives, shard arithmetic.

    tp = init_tp_group(2)            # after the default process group exists (torchrun)
    engine = Engine("ckpt/", cfg.rollout, tp=tp)

World = TP x DP: the TP groups are consecutive ranks ([0, 1], [2, 3], ... for TP = 2), each
one engine replica; DP replicas never talk to each other. Groups are created once per TP
size with `torch.distributed.new_group` and kept for the life of the process (every rank
takes part in creating every group, in the same order, as torch requires). They inherit the
default group's backends: NCCL for CUDA tensors, gloo for CPU tensors.

Every rank of a TP group runs the same schedule: it must get the same requests (checked
once per `generate` call with `check_same`), size the same KV pool (`min_int`) and draw
the same unseeded sampling seeds (`shared_seed`). Logits are gathered in full on every rank,
so the hash-based sampler picks the same tokens everywhere.

A `ShardRule` says which part of a full HF tensor one rank keeps: the slice
[src_start, src_start + length) along `dim` goes to [dest_start, ...) of the parameter.
Loading, the checksum readback of a weight sync and the tests all use the same rule.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from handoff.errors import HandoffError


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group (size 1: no group, no collectives)."""

    rank: int = 0
    size: int = 1
    group: object | None = None   # torch ProcessGroup when size > 1

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the group."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def shared_seed(self, device: torch.device) -> int | None:
        """A random seed that every rank of the group agrees on (None at size 1: OS entropy)."""
        if self.size == 1:
            return None
        t = torch.tensor([random.SystemRandom().getrandbits(62)], dtype=torch.int64,
                         device=device)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(t.item())

    def check_same(self, fingerprint: bytes, what: str, device: torch.device) -> None:
        """Raise on every rank unless all ranks passed the same fingerprint of `what`."""
        if self.size == 1:
            return
        digest = hashlib.blake2b(fingerprint, digest_size=7).digest()
        value = int.from_bytes(digest, "little")
        t = torch.tensor([value, -value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if int(t[0]) != value or int(t[1]) != -value:
            raise HandoffError(f"the ranks of a tensor-parallel engine got different {what}: every "
                               "rank of a TP group must make the same calls with the same "
                               "arguments (give each TP group's ranks the same prompts)")


SINGLE = TPGroup()
_GROUPS: dict[int, TPGroup] = {}


def init_tp_group(size: int) -> TPGroup:
    """This rank's TP group of `size` consecutive ranks (made once per size, then reused)."""
    if size < 1:
        raise HandoffError(f"tensor parallel size {size} is not positive: use 1 or more")
    if size == 1:
        return SINGLE
    if size in _GROUPS:
        return _GROUPS[size]
    if not dist.is_initialized():
        raise HandoffError(f"tensor parallel size {size} needs {size} processes: launch with "
                           f"`torchrun --nproc-per-node {size} -m handoff ...`, or use TP 1")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise HandoffError(f"tensor parallel size {size} does not divide the {world} processes "
                           f"started: launch a multiple of {size} processes, or pick a TP size "
                           f"that divides {world}")
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = TPGroup(rank=rank - start, size=size, group=group)
    _GROUPS[size] = mine
    return mine


# ---------------------------------------------------------------- shard arithmetic


@dataclass(frozen=True)
class ShardRule:
    """Rows (dim 0) or columns (dim 1) of a full tensor that one rank keeps, and where."""

    dim: int
    full_size: int     # the full tensor's size along `dim`
    src_start: int     # first index kept, in the full tensor
    dest_start: int    # where it goes, in the (possibly fused) parameter
    length: int

    def src(self, full: torch.Tensor) -> torch.Tensor:
        if self.length == self.full_size:   # all of it (TP = 1): no narrow, a sync's host
            return full                     # work is per tensor
        return full.narrow(self.dim, self.src_start, self.length)

    def dest(self, param: torch.Tensor) -> torch.Tensor:
        return param.narrow(self.dim, self.dest_start, self.length)

    def full_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        shape = list(param.shape)
        shape[self.dim] = self.full_size
        return tuple(shape)


def whole(size: int) -> ShardRule:
    """A replicated tensor: every rank keeps all of it."""
    return ShardRule(dim=0, full_size=size, src_start=0, dest_start=0, length=size)


def even_split(total: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `total`; TP must divide it."""
    if total % tp.size:
        raise HandoffError(f"tensor parallel size {tp.size} does not divide {what}={total}: use "
                           "a TP size that divides it")
    per = total // tp.size
    return tp.rank * per, per


def kv_head_split(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(first KV head, count) of this rank: split when TP divides them, else replicated.

    With TP > KV heads each rank keeps the one KV head its query heads read (rank r of T
    uses head r * K // T, HF's GQA grouping), so T / K ranks hold a copy of each."""
    if num_kv_heads % tp.size == 0:
        return even_split(num_kv_heads, tp, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise HandoffError(f"tensor parallel size {tp.size} and num_key_value_heads={num_kv_heads} "
                           "do not divide one another: use a TP size that divides the KV heads "
                           "or a multiple of them")
    return tp.rank * num_kv_heads // tp.size, 1


def vocab_split(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first id, ids kept, rows per rank): rows = ceil(V / TP); the last rank's tail is padding."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return start, min(per, vocab_size - start), per
