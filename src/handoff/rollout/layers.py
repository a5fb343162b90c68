"""Engine-layout building blocks: tensor-parallel linears, embedding and head, RMSNorm, RoPE tables.

Parameters are created with `torch.empty` on the target device (no init cost: the checkpoint
or the trainer fills them) so that building the model inside the memory pool's "weights"
region places exactly the weights there. Every sharded parameter carries `shard_rules`
(`ShardRule`, below), one per HF tensor fused into it (q/k/v, gate/up):
`load_weights` slices each full HF tensor by its rule, so the trainer always sends full
tensors. At TP = 1 the rules keep everything and no layer communicates. A `ShardRule` says
which part of a full HF tensor one rank keeps: the slice [src_start, src_start + length) along
`dim` goes to [dest_start, ...) of the parameter; loading, the checksum readback of a weight
sync and the tests all use the same rule.

Column-parallel layers keep output rows (q/k/v heads, gate/up) and need no communication;
row-parallel layers keep input columns (o_proj, down_proj) and all-reduce their output: one
all-reduce per block half. The embedding and the head split the vocabulary.

The two linears carry a `lora` slot (rollout/lora.py), None unless the engine has an
adapter: then it adds the adapter's delta to the output (before the all-reduce).

Shape legend: T = tokens, B = sequences, E = in features (hidden), F = out features,
V = vocabulary, H = heads, D = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from handoff.errors import HandoffError
from handoff.rollout import ops
from dataclasses import dataclass

from handoff.rollout.parallel import TPGroup


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


def _param(shape: tuple[int, ...], rules: tuple[ShardRule, ...], **kw) -> nn.Parameter:
    """An uninitialised frozen parameter that knows its shard rules (one per fused part)."""
    param = nn.Parameter(torch.empty(shape, **kw), requires_grad=False)
    param.shard_rules = rules
    return param


def shard_rules(param: torch.Tensor) -> tuple[ShardRule, ...]:
    """The rules of a parameter; one that has none is replicated whole."""
    return getattr(param, "shard_rules", None) or (whole(param.shape[0]),)


def adapter_rows(linear: nn.Module, max_rank: int) -> int:
    """Rows of LoRA A a decoder linear keeps after its weight (one A per fused part), so that
    one GEMM gives [x W^T | x A^T]: 0 where the output must stay one dense tensor (a bias
    added by the GEMM, or a row-parallel linear's partial sum that the all-reduce takes)."""
    if linear.bias is not None:
        return 0
    if isinstance(linear, RowParallelLinear):
        return max_rank if linear.tp.size == 1 else 0
    return len(shard_rules(linear.weight)) * max_rank


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with this rank's output rows; a fused projection lists its parts.

    `parts` holds one (full rows, first row kept, rows kept) per HF tensor fused here (q, k, v
    or gate, up); the kept rows are stacked in that order, and `shard_sizes` are their
    counts, so the output splits into this rank's q/k/v (or gate/up) with one `split`.
    """

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], *, bias: bool,
                 device=None, dtype=None):
        super().__init__()
        rules, dest = [], 0
        for full, start, length in parts:
            rules.append(ShardRule(dim=0, full_size=full, src_start=start, dest_start=dest,
                                   length=length))
            dest += length
        kw = {"device": device, "dtype": dtype}
        self.weight = _param((dest, in_features), tuple(rules), **kw)
        self.bias = _param((dest,), tuple(rules), **kw) if bias else None
        self.shard_sizes = tuple(length for _, _, length in parts)
        self.lora = None  # a rollout.lora.LoraSlot once an adapter is attached

    def forward(self, x_TE: torch.Tensor | ops.NormInput) -> torch.Tensor | ops.PendingTerm:
        """The fused projections' readers (qk_norm_rope_store, silu_mul) take a pending
        adapter term (ops.PendingTerm)."""
        return ops.linear(x_TE, self.weight, self.bias, self.lora, fold_term=True)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b: this rank keeps input columns, one all-reduce."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TPGroup,
                 device=None, dtype=None):
        super().__init__()
        start, per = even_split(in_features, tp, "the row-parallel input size")
        kw = {"device": device, "dtype": dtype}
        rule = ShardRule(dim=1, full_size=in_features, src_start=start, dest_start=0, length=per)
        self.weight = _param((out_features, per), (rule,), **kw)
        self.bias = _param((out_features,), (whole(out_features),), **kw) if bias else None
        self.tp = tp
        self.lora = None  # a rollout.lora.LoraSlot once an adapter is attached

    def forward(self, x_TE: torch.Tensor, *, gated: bool = False) -> torch.Tensor:
        """`gated`: x is the MLP's [gate | up], the input SiLU(gate) * up (ops.linear)."""
        # With an adapter, this rank's partial delta: the all-reduce sums them.
        y_TF = self.tp.all_reduce_(ops.linear(x_TE, self.weight, None, self.lora, gated=gated))
        return y_TF if self.bias is None else y_TF + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + kept) of the embedding; other ids give 0 here, then one all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPGroup, device=None,
                 dtype=None):
        super().__init__()
        self.start, kept, rows = vocab_split(vocab_size, tp)
        self.end = self.start + kept
        rule = ShardRule(dim=0, full_size=vocab_size, src_start=self.start, dest_start=0,
                         length=kept)
        self.weight = _param((rows, hidden_size), (rule,), device=device, dtype=dtype)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids_T, self.weight)
        mine_T = (ids_T >= self.start) & (ids_T < self.end)
        x_TE = F.embedding(torch.where(mine_T, ids_T - self.start, 0), self.weight)
        return self.tp.all_reduce_(x_TE * mine_T[:, None].to(x_TE.dtype))

    def logits(self, hidden_BE: torch.Tensor) -> torch.Tensor:
        """Full logits [B, V] on every rank: local rows, gathered, padding dropped."""
        logits_BV = self.tp.gather_last(ops.linear(hidden_BE, self.weight))
        return logits_BV if logits_BV.shape[-1] == self.vocab_size else logits_BV[:, :self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output head, split over the vocabulary like the embedding."""

    def forward(self, hidden_BE: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden_BE)


class RMSNorm(nn.Module):
    """weight * RMSNorm(x) as the HF models compute it (see handoff.rollout.ops).

    `add_and_norm` first adds the residual stream and returns (normed, x + residual): the
    decoder keeps that stream apart so that the add and the norm are one fused kernel.
    """

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * RMSNorm(x + residual), x + residual); no residual (first layer): x."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)

    def pending(self, x: torch.Tensor, residual: torch.Tensor | None) -> ops.NormInput:
        """add_and_norm left to the linear that reads it (ops.NormInput: the skinny kernel
        makes it as it reads; elsewhere add_and_norm's numbers)."""
        return ops.NormInput(x, residual, self.weight, self.eps)


def _rope_params(hf: dict) -> tuple[float, dict]:
    """(theta, scaling dict) from a transformers 5 (`rope_parameters`) or 4 config."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params or dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), {**scaling, "rope_type": kind}


def inverse_frequencies(hf: dict, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies [D/2] (fp32) for the default, linear and llama3 rope types."""
    theta, scaling = _rope_params(hf)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between the two cut-offs interpolated linearly in 1/wavelength.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        ramp = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return inv_freq / factor * (1 - ramp) + inv_freq * ramp
    raise HandoffError(f"rope type {kind!r} is not supported by the built-in engine: use a model "
                       "with default, linear or llama3 RoPE")


def rope_table(inv_freq: torch.Tensor, max_len: int) -> torch.Tensor:
    """[max_len, D] fp32: cos of every position in the first half, sin in the second."""
    freqs_LD2 = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs_LD2.cos(), freqs_LD2.sin()], dim=-1)
