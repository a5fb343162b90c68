"""Micro-batches of a rollout batch: right-padded rows, or whole sequences packed by tokens.

    groups = micro_batch_rows(lengths, micro_batch_tokens=16384, micro_batch_size=16)
    mb = PackedMicroBatch.build(batch, groups[0], lengths, device)
    logp, ent = forward.token_forward(model, mb, ...)    # [T, 1] packed, [b, w] padded
    loss = grpo.grpo_loss_sums(logp, mb.gather(batch.old_logprobs), mb.advantages(adv), ...)

A rollout batch's rows have very different lengths (a long tail of responses); right-padded
micro-batches of a fixed row count pay every GEMM and the [tokens x vocab] head for the pad.
Packing removes it: a micro-batch is one row of T = the sum of its sequences' lengths, the
position ids restart at 0 for every sequence (RoPE sees the positions it would unpacked),
and `train.attention` keeps each token's attention inside its own sequence. Per-token values
are laid out [T, 1], so grpo's per-row functions treat every token as a row of one (a
sequence's advantage repeated on its tokens) and its token sums, hence the loss, equal the
padded path's up to float summation order.

Bins are filled first-fit in order of decreasing length (fewer micro-batches than a plain
sequential fill when lengths are long-tailed); a sequence longer than the budget gets a
micro-batch of its own (a sequence is never split: its tokens attend to each other).
Shape legend: T packed tokens, N sequences in a micro-batch, B rows of the batch, b rows of
a padded micro-batch, w its width (its longest row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from handoff.memory.host_copy import upload
from handoff.trainer.batch import RolloutBatch


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices per micro-batch: first-fit decreasing, each bin at most `budget` tokens
    (a longer row alone); bins in order of their first row, rows in a bin in batch order."""
    assert budget > 0, "the token budget must be positive"
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, left in enumerate(room):
            if lengths[row] <= left:
                bins[b].append(row)
                room[b] -= lengths[row]
                break
        else:
            bins.append([row])
            room.append(budget - lengths[row])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def micro_batch_rows(lengths: list[int], *, micro_batch_tokens: int,
                     micro_batch_size: int) -> list[list[int]]:
    """The rows of each micro-batch: packed by tokens when micro_batch_tokens > 0, else
    consecutive runs of micro_batch_size rows (right-padded to their longest)."""
    if micro_batch_tokens > 0:
        return pack_rows(lengths, micro_batch_tokens)
    n = len(lengths)
    return [list(range(i, min(n, i + micro_batch_size))) for i in range(0, n, micro_batch_size)]


@dataclass(frozen=True)
class PackedSeqs:
    """What packed attention needs per micro-batch (built once, shared by every layer)."""

    cu_seqlens: torch.Tensor    # [N + 1] int32 on the device: sequence starts in the packed row
    max_len: int                # longest sequence
    seq_T: torch.Tensor         # [T] int64: which sequence (0..N-1) each token belongs to
    pos_T: torch.Tensor         # [T] int64: its position inside that sequence
    num_seqs: int


@dataclass
class PackedMicroBatch:
    """One packed micro-batch: model inputs [1, T] and the map from tokens back to rows."""

    rows: list[int]
    input_ids: torch.Tensor     # [1, T]
    row_T: torch.Tensor         # [T] the batch row of each token
    seqs: PackedSeqs
    packed = True

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def model_kwargs(self) -> dict:
        return {"input_ids": self.input_ids, "position_ids": self.seqs.pos_T[None],
                "handoff_packing": self.seqs}

    @classmethod
    def build(cls, batch: RolloutBatch, rows: list[int], lengths: list[int],
              device: torch.device) -> "PackedMicroBatch":
        """`lengths`: every row's token count (attention_mask sums), read once per batch.
        The index tensors are built on the host and go to the device as one copy."""
        lengths_N = torch.tensor([lengths[r] for r in rows], dtype=torch.int64)
        num, total = len(rows), int(lengths_N.sum())
        ends_N = torch.cumsum(lengths_N, 0)
        seq_T = torch.repeat_interleave(torch.arange(num), lengths_N, output_size=total)
        host = torch.cat([torch.zeros(1, dtype=torch.int64), ends_N, seq_T,
                          torch.arange(total) - (ends_N - lengths_N)[seq_T],
                          torch.tensor(rows, dtype=torch.int64)[seq_T]])
        cu, seq_T, pos_T, row_T = torch.split(upload(host, device), [num + 1, total, total, total])
        seqs = PackedSeqs(cu_seqlens=cu.to(torch.int32), max_len=int(lengths_N.max()),
                          seq_T=seq_T, pos_T=pos_T, num_seqs=num)
        ids_T = batch.input_ids.to(device, non_blocking=True)[row_T, pos_T]
        return cls(rows=list(rows), input_ids=ids_T[None], row_T=row_T, seqs=seqs)

    def per_token(self, values_1T: torch.Tensor) -> torch.Tensor:
        """Model results [1, T] -> [T, 1]; a sequence's first token has no prediction: 0."""
        return values_1T[0].masked_fill(self.seqs.pos_T == 0, 0.0)[:, None]

    def gather(self, t_BT: torch.Tensor | None) -> torch.Tensor | None:
        """A [B, T] batch tensor's values at this micro-batch's tokens, [T, 1]."""
        if t_BT is None:
            return None
        return t_BT.to(self.row_T.device, non_blocking=True)[self.row_T, self.seqs.pos_T][:, None]

    def advantages(self, adv_B: torch.Tensor) -> torch.Tensor:
        return adv_B.to(self.row_T.device, non_blocking=True)[self.row_T]

    def scatter(self, out_BT: torch.Tensor, values_T1: torch.Tensor) -> None:
        out_BT[self.row_T, self.seqs.pos_T] = values_T1[:, 0]


@dataclass
class PaddedMicroBatch:
    """Consecutive rows [start, stop) right-padded to the longest of them (today's layout)."""

    start: int
    stop: int
    input_ids: torch.Tensor     # [b, w]
    packed = False

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def model_kwargs(self) -> dict:
        # Right padding is never attended to by a real token under the causal mask.
        return {"input_ids": self.input_ids}

    @classmethod
    def build(cls, batch: RolloutBatch, rows: list[int], lengths: list[int],
              device: torch.device) -> "PaddedMicroBatch":
        start, stop = rows[0], rows[-1] + 1
        width = max(max(lengths[start:stop]), 1)
        return cls(start=start, stop=stop,
                   input_ids=batch.input_ids[start:stop, :width].to(device, non_blocking=True))

    def per_token(self, values_bw: torch.Tensor) -> torch.Tensor:
        return values_bw

    def gather(self, t_BT: torch.Tensor | None) -> torch.Tensor | None:
        if t_BT is None:
            return None
        width = self.input_ids.shape[1]
        return t_BT[self.start:self.stop, :width].to(self.input_ids.device, non_blocking=True)

    def advantages(self, adv_B: torch.Tensor) -> torch.Tensor:
        return adv_B[self.start:self.stop].to(self.input_ids.device, non_blocking=True)

    def scatter(self, out_BT: torch.Tensor, values_bw: torch.Tensor) -> None:
        out_BT[self.start:self.stop, :values_bw.shape[1]] = values_bw


def build_micro_batch(batch: RolloutBatch, rows: list[int], lengths: list[int],
                      device: torch.device, *, packed: bool):
    cls = PackedMicroBatch if packed else PaddedMicroBatch
    return cls.build(batch, rows, lengths, device)
