"""The trainer's attention: SDPA for right-padded rows, varlen for packed sequences.

    load the model with attn_implementation=ATTN_IMPLEMENTATION ("handoff_packed")
    model(input_ids=ids_1T, position_ids=pos_1T, handoff_packing=seqs)   # packed
    model(input_ids=ids_BT)                                               # padded, as before

Registered in transformers' AttentionInterface under one name, so one loaded model serves
both layouts. Without `handoff_packing` the call goes to transformers' own SDPA function
unchanged (causal, no mask: right padding is never attended to by a real token). No mask
function is registered for the name, so transformers builds no [T x T] mask for it; with
`sdpa` and restarting position ids it would detect the packing and build a dense
block-causal mask, which keeps SDPA off its flash kernel and costs T^2 bytes per call.

With `handoff_packing` (a train.packing.PackedSeqs), q/k/v are one packed row [1, H, T, D]:
* CUDA, bf16/fp16, and torch's `torch.nn.attention.varlen.varlen_attn` whose backward works
  (probed once per device with a tiny GQA case): FlashAttention-2 varlen over cu_seqlens,
  causal inside each sequence. Exact, has a backward, GQA native, and costs only the real
  tokens' attention. Chosen over flex attention (needs torch.compile of a block mask per
  micro-batch shape, with recompiles as lengths change) and over transformers' packed
  SDPA path (the dense mask above).
* otherwise (CPU, fp32, a torch without a working varlen backward): the packed tokens are
  scattered into a padded [N, H, L_max, D] batch, run through causal SDPA, and gathered
  back. Exact as well (pad keys come after every real query), only the attention itself is
  padded: the GEMMs around it still see packed tokens. It is also the tests' reference.
Shape legend: B rows, T tokens, N sequences, H query heads, K kv heads, D head_dim.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from handoff.varlen import varlen_attention, varlen_available

ATTN_IMPLEMENTATION = "handoff_packed"


def _varlen_call(q_THD, k_TKD, v_TKD, cu, max_len: int, scale: float) -> torch.Tensor:
    return varlen_attention(q_THD, k_TKD, v_TKD, cu, cu, max_len, max_len, scale=scale,
                            enable_gqa=q_THD.shape[1] != k_TKD.shape[1])


@functools.lru_cache(maxsize=8)
def varlen_trains(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether varlen_attn runs forward and backward here and agrees with padded_sdpa on a
    tiny GQA case of two sequences (checked once per device and dtype)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not varlen_available():
        return False
    try:
        with torch.enable_grad():
            return _varlen_matches_reference(device, dtype)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


def _varlen_matches_reference(device: torch.device, dtype: torch.dtype) -> bool:
    from handoff.trainer.packing import PackedSeqs

    g = torch.Generator(device=device).manual_seed(0)
    shapes = ((24, 4, 64), (24, 2, 64), (24, 2, 64))
    qkv = [torch.randn(s, device=device, dtype=dtype, generator=g) for s in shapes]
    lengths = torch.tensor([10, 14], device=device)
    seq_T = torch.repeat_interleave(torch.arange(2, device=device), lengths)
    seqs = PackedSeqs(cu_seqlens=torch.tensor([0, 10, 24], device=device, dtype=torch.int32),
                      max_len=14, seq_T=seq_T, pos_T=torch.arange(24, device=device)
                      - torch.tensor([0, 10], device=device)[seq_T], num_seqs=2)
    outs, grads = [], []
    for fn in (lambda q, k, v: _varlen_call(q, k, v, seqs.cu_seqlens, 14, 0.125),
               lambda q, k, v: padded_sdpa(q, k, v, seqs, 0.125)):
        leaves = [x.clone().requires_grad_(True) for x in qkv]
        out = fn(*leaves)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append(torch.cat([x.grad.float().flatten() for x in leaves]))
    return bool(torch.allclose(outs[0], outs[1], atol=2e-2, rtol=2e-2)
                and torch.allclose(grads[0], grads[1], atol=5e-2, rtol=5e-2))


def backend_for(device: torch.device, dtype: torch.dtype) -> str:
    """'varlen' or 'padded_sdpa': what packed attention runs on this device and dtype."""
    return "varlen" if varlen_trains(torch.device(device), dtype) else "padded_sdpa"


def padded_sdpa(q_THD, k_TKD, v_TKD, seqs, scale: float) -> torch.Tensor:
    """Packed -> padded [N, L_max] -> causal SDPA -> packed: exact on any device and dtype."""
    n, length = seqs.num_seqs, seqs.max_len

    def pad(x_TXD: torch.Tensor) -> torch.Tensor:
        out = x_TXD.new_zeros(n, length, *x_TXD.shape[1:])
        out[seqs.seq_T, seqs.pos_T] = x_TXD
        return out.transpose(1, 2)                      # [N, X, L, D]

    o_NHLD = F.scaled_dot_product_attention(pad(q_THD), pad(k_TKD), pad(v_TKD), is_causal=True,
                                            scale=scale,
                                            enable_gqa=q_THD.shape[1] != k_TKD.shape[1])
    return o_NHLD.transpose(1, 2)[seqs.seq_T, seqs.pos_T]


@torch.compiler.disable   # one kernel already; its backend probe must not be traced (compiled.py)
def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                     scaling: float | None = None, dropout: float = 0.0,
                     handoff_packing=None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D] -> ([B, T, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if handoff_packing is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    assert query.shape[0] == 1, "a packed micro-batch is one row"
    assert attention_mask is None and dropout == 0.0, "packed attention takes no mask or dropout"
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("packed micro-batches do not support sliding-window layers: "
                                  "set actor.micro_batch_tokens=0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_THD, k_TKD, v_TKD = (x[0].transpose(0, 1) for x in (query, key, value))
    if backend_for(query.device, query.dtype) == "varlen":
        seqs = handoff_packing
        out_THD = _varlen_call(q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous(),
                               seqs.cu_seqlens, seqs.max_len, scale)
    else:
        out_THD = padded_sdpa(q_THD, k_TKD, v_TKD, handoff_packing, scale)
    return out_THD[None], None


def register() -> None:
    """Make ATTN_IMPLEMENTATION a name transformers' from_pretrained accepts (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)
