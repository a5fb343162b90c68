"""Paged prefill attention: each sequence's new queries against its whole cached context.

The new tokens' K/V are already in the paged cache (the engine stores before it attends), and a
prefix-cache hit means the context is longer than the queries. We gather every sequence's
context into packed [total_keys, K, D] tensors with one indexed read, then run
torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen, GQA native, causal aligned to
the bottom right, so query i of a sequence sees keys up to its own position) on CUDA. torch
2.11's varlen_attn takes no block table, hence the gather: it reads and writes the context
once, small next to the prefill's matrix products. Elsewhere (CPU, or a torch without
varlen_attn) a per-sequence SDPA loop runs instead; it is also the test reference's twin.
Shape legend: T query tokens (packed), L key tokens (packed), B sequences, H query heads,
K kv heads, D head_dim, N block_size.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from handoff import varlen
from handoff.errors import HandoffError


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, seq_L: torch.Tensor,
                   pos_L: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """Rows (seq_L[i], pos_L[i]) of the paged cache as [L, K, D] in dtype (fp8 dequantized)."""
    block_size = cache.shape[1]
    slot_L = block_tables[seq_L, pos_L // block_size].long() * block_size + pos_L % block_size
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == torch.float8_e4m3fn:  # index through bytes: fp8 indexing is not everywhere
        return (flat.view(torch.uint8)[slot_L].view(cache.dtype).float() * scale).to(dtype)
    return flat[slot_L].to(dtype)


def _sdpa_loop(q_THD, k_LKD, v_LKD, query_lens, context_lens, scale) -> torch.Tensor:
    out_THD = torch.empty_like(q_THD)
    tq = tk = 0
    for nq, nk in zip(query_lens, context_lens):
        keep_QL = (torch.arange(nk, device=q_THD.device)[None, :]
                   <= torch.arange(nq, device=q_THD.device)[:, None] + (nk - nq))
        o_1HQD = F.scaled_dot_product_attention(
            q_THD[tq:tq + nq].transpose(0, 1)[None], k_LKD[tk:tk + nk].transpose(0, 1)[None],
            v_LKD[tk:tk + nk].transpose(0, 1)[None], attn_mask=keep_QL, scale=scale,
            enable_gqa=True)
        out_THD[tq:tq + nq] = o_1HQD[0].transpose(0, 1)
        tq, tk = tq + nq, tk + nk
    return out_THD


def varlen_available() -> bool:
    """Whether this torch has varlen_attn (FlashAttention-2 varlen: CUDA, bf16/fp16)."""
    return varlen.varlen_available()


def varlen_attention(q_THD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor,
                     cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, *,
                     scale: float) -> torch.Tensor:
    """Causal varlen attention on packed q and K/V (cu_* int32 [B + 1] on q's device) -> [T, H, D].

    Query i of a sequence sees its keys up to position i + (keys - queries): the queries are
    the last of their sequence's keys.
    """
    return varlen.varlen_attention(q_THD, k_LKD, v_LKD, cu_q, cu_k, max_q, max_k, scale=scale,
                                   enable_gqa=True)


def paged_prefill_attention(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_lens: list[int],
                            context_lens: list[int], *, scale: float, k_scale=None,
                            v_scale=None, backend: str = "auto") -> torch.Tensor:
    """Causal attention of packed new queries over each sequence's cached context -> [T, H, D].

    query_lens[b] new tokens of sequence b are the last of its context_lens[b] cached tokens
    (equal when nothing was cached). backend: auto (varlen on CUDA when torch has it, else
    sdpa) | varlen | sdpa.
    """
    if len(query_lens) != len(context_lens) or len(query_lens) > block_tables.shape[0] or \
            any(not 0 < nq <= nk for nq, nk in zip(query_lens, context_lens)):
        raise HandoffError("paged_prefill_attention: need one (query_len, context_len) per "
                           "sequence with 0 < query_len <= context_len and a block-table row "
                           f"each; got {list(query_lens)} and {list(context_lens)}")
    if sum(query_lens) != q_THD.shape[0]:
        raise HandoffError(f"paged_prefill_attention: q has {q_THD.shape[0]} tokens but "
                           f"query_lens sum to {sum(query_lens)}: pack exactly those tokens")
    if k_cache.dtype == torch.float8_e4m3fn and (k_scale is None or v_scale is None):
        raise HandoffError("paged_prefill_attention: the cache is float8_e4m3fn but k_scale/"
                           "v_scale are missing: pass the layer's float32 scales")
    if backend == "auto":
        backend = "varlen" if q_THD.is_cuda and varlen_available() else "sdpa"
    if backend not in ("varlen", "sdpa") or (backend == "varlen" and not varlen_available()):
        raise HandoffError(f"paged_prefill_attention: backend {backend!r} is unavailable here: "
                           "use auto or sdpa")
    device = q_THD.device
    cu = torch.tensor([0] + list(context_lens), dtype=torch.int64).cumsum(0)
    cu_q = torch.tensor([0] + list(query_lens), dtype=torch.int64).cumsum(0)
    lens_B = torch.tensor(list(context_lens), device=device)
    total = int(cu[-1])
    seq_L = torch.repeat_interleave(torch.arange(len(context_lens), device=device), lens_B,
                                    output_size=total)
    pos_L = torch.arange(total, device=device) - cu.to(device)[seq_L]
    k_LKD = gather_context(k_cache, block_tables, seq_L, pos_L, k_scale, q_THD.dtype)
    v_LKD = gather_context(v_cache, block_tables, seq_L, pos_L, v_scale, q_THD.dtype)
    if backend == "sdpa":
        return _sdpa_loop(q_THD, k_LKD, v_LKD, query_lens, context_lens, scale)
    return varlen_attention(q_THD, k_LKD, v_LKD, cu_q.to(device, torch.int32),
                            cu.to(device, torch.int32), max(query_lens), max(context_lens),
                            scale=scale)
