"""torch's varlen attention (FlashAttention over packed sequences), across torch releases.

    if varlen_available(): out_THD = varlen_attention(q_THD, k_TKD, v_TKD, cu_q, cu_k,
                                                      max_q, max_k, scale=s, enable_gqa=True)

Its keywords changed between releases (torch >= 2.11 takes a causal `window_size` instead of
`is_causal`; `scale` and `enable_gqa` came later than the function): one call, which the
engine's prefill and the trainer's packed attention share. Shape legend: T packed query
tokens, K packed keys, H heads, D head dim.
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=1)
def _varlen():
    """varlen_attn and the keywords this torch accepts, or None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available() -> bool:
    return _varlen() is not None


def varlen_attention(q_THD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
                     cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, *,
                     scale: float, enable_gqa: bool) -> torch.Tensor:
    """Causal varlen attention (query i of a sequence sees its keys up to i + keys - queries)."""
    varlen_attn, params = _varlen()
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if "enable_gqa" in params:
        kw["enable_gqa"] = enable_gqa
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale * q_THD.shape[-1] ** 0.5 - 1.0) > 1e-6:   # fold a custom scale into q
        q_THD = q_THD * (scale * q_THD.shape[-1] ** 0.5)
    return varlen_attn(q_THD, k_KHD, v_KHD, cu_q, cu_k, max_q, max_k, **kw)
