"""Engine-layout building blocks: linear layers with fused shards, RMSNorm, rotary tables.

Parameters are created with `torch.empty` on the target device (no init cost: the checkpoint
or the trainer fills them) so that building the model inside the memory pool's "weights"
region places exactly the weights there. A fused linear (qkv, gate_up) records its shard
sizes so `load_weights` can copy each HF tensor into its rows.

Shape legend: T = tokens, E = in features, F = out features, H = heads, D = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from handoff.errors import HandoffError


class Linear(nn.Module):
    """y = x W^T + b; `shard_sizes` splits the output rows of a fused projection."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 shard_sizes: tuple[int, ...] | None = None, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype),
                                  requires_grad=False) if bias else None)
        self.shard_sizes = shard_sizes or (out_features,)
        assert sum(self.shard_sizes) == out_features

    def shard_slice(self, shard: int) -> tuple[int, int]:
        """(start row, num rows) of shard `shard` in the fused output."""
        return sum(self.shard_sizes[:shard]), self.shard_sizes[shard]

    def forward(self, x_TE: torch.Tensor) -> torch.Tensor:
        return F.linear(x_TE, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as the HF models do."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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


def apply_rope(x_THD: torch.Tensor, cos_T1D2: torch.Tensor, sin_T1D2: torch.Tensor) -> torch.Tensor:
    """Rotate halves (HF `rotate_half` convention) by the positions' angles."""
    x1, x2 = x_THD.chunk(2, dim=-1)
    return torch.cat([x1 * cos_T1D2 - x2 * sin_T1D2, x2 * cos_T1D2 + x1 * sin_T1D2], dim=-1)
