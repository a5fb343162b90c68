"""Paged attention: the KV store, the plain-torch reference paths, and the one backend switch.

KV layout (shared with the Triton kernels in rollout/kernels/): per layer `k_cache`, `v_cache`
of shape [num_blocks, block_size, num_kv_heads, head_dim]; `block_tables` int32
[batch, max_blocks_per_seq]; `context_lens` int32 [batch]; `slot_mapping` int64 [tokens] with
slot = block * block_size + offset. Block 0 is the engine's null block: it is never given to a
sequence, block tables are padded with 0 and padded tokens (slot -1) are written into it, so
every index is valid and a captured graph needs no branch. fp8 (e4m3) caches store value/scale
with one fp32 scale per layer for K and one for V; readers multiply back.

Within one layer every new token's K/V is stored before any query attends, so a sequence may
read blocks another sequence of the same prefill is writing (shared prompt prefixes rely on it).

The decode backend is chosen once per runner (`select_decode_backend`): "torch" (gather each
sequence's blocks, then SDPA; runs anywhere, the reference) or "triton" (the CUDA kernel).
Prefill on CUDA (bf16/fp16) is one varlen_attn call per layer over the packed sequences
(`PackedPrefill`, built once per step by the runner): the context keys are gathered from the
cache by slot, or taken straight from the new tokens when nothing was cached and the cache
holds the model dtype. Elsewhere a per-sequence SDPA loop runs (the reference).

Shape legend: T = tokens, B = sequences, H = query heads, K = KV heads, D = head dim,
N = blocks in the pool, S = block size, M = blocks per sequence, L = keys attended.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from handoff.errors import HandoffError

if TYPE_CHECKING:
    from handoff.rollout.kernels.prefetch import LayerPrefetch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class KVCache:
    """Per-layer cache tensors (views into one allocation) and fp8 scales (None unless fp8)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scale: list[torch.Tensor] | None = None  # fp32 [] per layer
    v_scale: list[torch.Tensor] | None = None


@dataclass
class AttnMeta:
    """What one forward needs to write and read the paged cache (kv None: no cache at all)."""

    is_prefill: bool
    kv: KVCache | None
    slot_mapping_T: torch.Tensor | None = None
    block_tables_BM: torch.Tensor | None = None
    context_lens_B: torch.Tensor | None = None
    query_lens: list[int] = field(default_factory=list)     # prefill, on the host
    context_lens: list[int] = field(default_factory=list)   # prefill, on the host
    decode_fn: Callable | None = None
    order_B: torch.Tensor | None = None   # decode: the rows longest first (graphs.DecodeInputs)
    packed: "PackedPrefill | None" = None                    # prefill through varlen_attn
    prefetch: "LayerPrefetch | None" = None   # decode: next weights asked for in L2


@dataclass
class PackedPrefill:
    """One prefill step's varlen layout, shared by every layer.

    key_slots_L: cache slot of every context key, sequences packed in order; cu_q / cu_k:
    int32 [B + 1] cumulative query / key counts; fresh: no sequence has cached tokens.
    """

    key_slots_L: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    fresh: bool


def _to_storage(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if cache.dtype == FP8_DTYPE:
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x.to(cache.dtype)


def _from_storage(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == FP8_DTYPE:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def store_kv(k_TKD: torch.Tensor, v_TKD: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping_T: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write each token's K/V at its slot; slot -1 (padding) lands in the null block 0."""
    slots_T = slot_mapping_T.clamp(min=0)
    for x_TKD, cache, scale in ((k_TKD, k_cache, k_scale), (v_TKD, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        src = _to_storage(x_TKD, cache, scale)
        if cache.dtype == FP8_DTYPE:  # index_copy_ has no fp8 kernel everywhere; bytes do
            flat, src = flat.view(torch.uint8), src.view(torch.uint8)
        flat.index_copy_(0, slots_T, src)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, scale, dtype) -> torch.Tensor:
    """[..., M] block ids -> [..., M * S, K, D] in `dtype`."""
    blocks = cache.view(torch.uint8)[block_ids].view(cache.dtype) if cache.dtype == FP8_DTYPE \
        else cache[block_ids]
    blocks = _from_storage(blocks, scale, dtype)
    return blocks.flatten(-4, -3)


def paged_decode_attention_torch(q_BHD: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, *, scale: float,
                                 k_scale: torch.Tensor | None = None,
                                 v_scale: torch.Tensor | None = None,
                                 out: torch.Tensor | None = None,
                                 order: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its first context_lens[b] cached tokens. (`order`,
    the order the Triton kernel starts rows in, changes nothing here.)"""
    block_ids_BM = block_tables.long()
    k_BLKD = _gather(k_cache, block_ids_BM, k_scale, q_BHD.dtype)
    v_BLKD = _gather(v_cache, block_ids_BM, v_scale, q_BHD.dtype)
    num_keys = k_BLKD.shape[1]
    # A padded row (context 0) still sees one key, so it yields numbers rather than NaN.
    valid_BL = (torch.arange(num_keys, device=q_BHD.device)[None, :]
                < context_lens.clamp(min=1)[:, None])
    o_BH1D = F.scaled_dot_product_attention(
        q_BHD[:, :, None, :], k_BLKD.transpose(1, 2), v_BLKD.transpose(1, 2),
        attn_mask=valid_BL[:, None, None, :], scale=scale, enable_gqa=True)
    o_BHD = o_BH1D.squeeze(2)
    if out is None:
        return o_BHD
    return out.copy_(o_BHD)


def _causal_attention(q_QHD, k_LKD, v_LKD, scale: float) -> torch.Tensor:
    """Queries are the last Q of the L positions; each sees keys up to its own position."""
    num_q, num_k = q_QHD.shape[0], k_LKD.shape[0]
    if num_q == num_k:
        mask = None
    else:
        mask = (torch.arange(num_k, device=q_QHD.device)[None, :]
                <= torch.arange(num_q, device=q_QHD.device)[:, None] + (num_k - num_q))
    o_1HQD = F.scaled_dot_product_attention(
        q_QHD.transpose(0, 1)[None], k_LKD.transpose(0, 1)[None], v_LKD.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return o_1HQD[0].transpose(0, 1)


def prefill_attention_torch(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttnMeta, *, scale: float, k_scale=None,
                            v_scale=None) -> torch.Tensor:
    """Each sequence's new queries against its whole cached context (prefix hits included)."""
    out_THD = torch.empty_like(q_THD)
    block_size = k_cache.shape[1]
    start = 0
    for i, (num_q, num_k) in enumerate(zip(meta.query_lens, meta.context_lens)):
        block_ids = meta.block_tables_BM[i, :-(-num_k // block_size)].long()
        k_LKD = _gather(k_cache, block_ids, k_scale, q_THD.dtype)[:num_k]
        v_LKD = _gather(v_cache, block_ids, v_scale, q_THD.dtype)[:num_k]
        out_THD[start:start + num_q] = _causal_attention(q_THD[start:start + num_q], k_LKD,
                                                          v_LKD, scale)
        start += num_q
    return out_THD


def gather_slots(cache: torch.Tensor, slots_L: torch.Tensor, scale,
                 dtype: torch.dtype) -> torch.Tensor:
    """Cache rows at flat slots -> [L, K, D] in `dtype` (fp8 dequantized)."""
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == FP8_DTYPE:
        return _from_storage(flat.view(torch.uint8)[slots_L].view(FP8_DTYPE), scale, dtype)
    return flat[slots_L].to(dtype)


def prefill_attention_packed(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             packed: PackedPrefill, *, scale: float, k_scale=None,
                             v_scale=None) -> torch.Tensor:
    """Every sequence's new queries against its context in one varlen_attn call (CUDA)."""
    from handoff.rollout.kernels.prefill import varlen_attention

    if packed.fresh and k_cache.dtype == q_THD.dtype:
        # The keys are exactly the new tokens, bit for bit what the cache now holds.
        k_LKD, v_LKD = k_TKD.contiguous(), v_TKD.contiguous()
    else:
        k_LKD = gather_slots(k_cache, packed.key_slots_L, k_scale, q_THD.dtype)
        v_LKD = gather_slots(v_cache, packed.key_slots_L, v_scale, q_THD.dtype)
    return varlen_attention(q_THD.contiguous(), k_LKD, v_LKD, packed.cu_q, packed.cu_k,
                            packed.max_q, packed.max_k, scale=scale)


def attend(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, meta: AttnMeta,
           layer: int, *, scale: float) -> torch.Tensor:
    """Attend over the cache, which already holds this layer's new K/V (ops.qk_norm_rope_store
    wrote them): the single attention entry point the model calls."""
    kv = meta.kv
    if kv is None:  # profiling forward before the pool exists: fresh prompts only
        out_THD, start = torch.empty_like(q_THD), 0
        for num_q in meta.query_lens:
            end = start + num_q
            out_THD[start:end] = _causal_attention(q_THD[start:end], k_TKD[start:end],
                                                    v_TKD[start:end], scale)
            start = end
        return out_THD
    k_scale = kv.k_scale[layer] if kv.k_scale is not None else None
    v_scale = kv.v_scale[layer] if kv.v_scale is not None else None
    if meta.packed is not None:
        return prefill_attention_packed(q_THD, k_TKD, v_TKD, kv.k[layer], kv.v[layer],
                                        meta.packed, scale=scale, k_scale=k_scale,
                                        v_scale=v_scale)
    if meta.is_prefill:
        return prefill_attention_torch(q_THD, kv.k[layer], kv.v[layer], meta, scale=scale,
                                       k_scale=k_scale, v_scale=v_scale)
    return meta.decode_fn(q_THD, kv.k[layer], kv.v[layer], meta.block_tables_BM,
                          meta.context_lens_B, scale=scale, k_scale=k_scale, v_scale=v_scale,
                          order=meta.order_B)


def select_decode_backend(device: torch.device, dtype: torch.dtype,
                          name: str | None = None) -> tuple[str, Callable]:
    """(name, decode fn): "auto" takes the Triton kernel on CUDA for bf16/fp16 models.

    `name` defaults to $HANDOFF_ATTENTION or "auto"; pass "torch" to force the reference.
    """
    name = name or os.environ.get("HANDOFF_ATTENTION", "auto")
    if name not in ("auto", "torch", "triton"):
        raise HandoffError(f"attention backend {name!r} is unknown: use auto, torch or triton")
    half = dtype in (torch.bfloat16, torch.float16)
    if name == "triton" and not half:
        raise HandoffError(f"attention backend 'triton' needs a bf16/fp16 model, not {dtype}: "
                           "use auto or torch")
    if name in ("auto", "triton") and device.type == "cuda" and half:
        try:
            from handoff.rollout.kernels import paged_decode_attention
            return "triton", paged_decode_attention
        except ImportError:
            if name == "triton":
                raise HandoffError("attention backend 'triton' asked for but "
                                   "handoff.rollout.kernels is unavailable: use auto or torch")
    elif name == "triton":
        raise HandoffError(f"attention backend 'triton' needs a CUDA device, not {device.type}: "
                           "use auto or torch")
    return "torch", paged_decode_attention_torch


def packed_prefill_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prefill can run as one varlen_attn call per layer (CUDA, bf16/fp16)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    from handoff.rollout.kernels.prefill import varlen_available

    return varlen_available() and _varlen_agrees(device, dtype)


@functools.lru_cache(maxsize=8)
def _varlen_agrees(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per device: varlen_attn with more keys than queries (a prefix hit) equals SDPA.

    Its causal alignment and keywords differ between torch releases; a mismatch falls back to
    the per-sequence loop with a warning instead of generating from wrong attention.
    """
    from handoff.rollout.kernels.prefill import varlen_attention

    gen = torch.Generator(device="cpu").manual_seed(0)
    q_THD, k_LKD, v_LKD = (torch.randn(n, h, 64, generator=gen).to(device, dtype)
                           for n, h in ((5, 4), (12, 2), (12, 2)))
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 12], dtype=torch.int32, device=device)
    try:
        out_THD = varlen_attention(q_THD, k_LKD, v_LKD, cu_q, cu_k, 3, 8, scale=0.125)
        q32, k32, v32 = q_THD.float(), k_LKD.float(), v_LKD.float()
        ref_THD = torch.cat([_causal_attention(q32[a:b], k32[c:d], v32[c:d], 0.125)
                             for a, b, c, d in ((0, 2, 0, 4), (2, 5, 4, 12))])
        err = (out_THD.float() - ref_THD).abs().max().item()
    except Exception as e:  # an API this code does not know: fall back, say why
        err, why = float("inf"), f"{type(e).__name__}: {e}"
    else:
        why = f"max error {err:.3g} against SDPA"
    if not err < 5e-2:  # bf16 rounding is ~1e-2 here; a misaligned mask is ~1
        warnings.warn(f"varlen_attn disagrees with SDPA on a prefix-hit case ({why}): prefill "
                      "falls back to the per-sequence SDPA loop (slower, correct)", stacklevel=3)
        return False
    return True
