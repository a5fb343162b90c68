"""Tensor parallelism for the rollout engine: the TP group and its collectives.

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

Which part of a full HF tensor one rank keeps (`ShardRule`) is the layers' own arithmetic
(rollout/layers.py).
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
