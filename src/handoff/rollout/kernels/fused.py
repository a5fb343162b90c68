"""Fused elementwise kernels of one decoder layer (Triton): the small ops between the GEMMs.

Unfused, a decode step of a Qwen3 layer launches ~29 tiny kernels besides its 4 matrix
products and its attention (RoPE alone is 7 per tensor); at batch 1 they cost more device time
than the GEMMs (docs/PERF.md). These three replace them with 3 launches per layer:

* add_rms_norm: residual add + RMSNorm + weight, one row per program;
* qk_norm_rope_store: per-head RMSNorm of q and k (Qwen3), RoPE of q and k (rotate-half
  convention), in place in the fused qkv projection output, and the new K/V written to the
  paged cache at their slots (fp8 caches: divided by the layer's scale, clamped, cast);
* silu_mul: SiLU(gate) * up of the fused gate_up projection output.

With a LoRA adapter (rollout/lora.py) the last two also add the fused projection's adapter
term t B^T to what they read (`term`), so the expand needs no launch of its own: at decode
batch a launch costs about what that small product does. Their grids then tile rows and
heads (or column blocks), so each program reads a few KB of B and the card shares the read.
add_term adds a term alone, in the same tiles, where the reader needs whole rows (o, down).

Numbers: each kernel rounds to the model dtype exactly where the plain-torch reference
(handoff.rollout.ops) does, so bf16 results match it bit for bit but for the order of the
fp32 sums inside a norm. Grids depend on shapes only, so the launches capture in CUDA graphs.

Shape legend: T = tokens, E = hidden size, H = query heads, K = KV heads, D = head dim
(D2 = D / 2, padded: D2P), I = intermediate size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from handoff.rollout.attention import FP8_MAX
from handoff.rollout.kernels.pdl import launch, pdl_on, wait_for_previous


FP8_MAX_F = tl.constexpr(FP8_MAX)  # a global a kernel reads must be a constexpr


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         stride_x, stride_res, stride_out, stride_res_out,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)  # the residual stream is kept in the model dtype
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(dtype), mask=mask)


def add_rms_norm(x_TE: torch.Tensor, residual_TE: torch.Tensor | None, weight_E: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual); without a residual the sum is x."""
    rows, n = x_TE.shape
    out = torch.empty_like(x_TE)
    res_out = torch.empty_like(x_TE) if residual_TE is not None else x_TE
    res_in = residual_TE if residual_TE is not None else x_TE
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x_TE, res_in, weight_E, out, res_out, n, eps,
        x_TE.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual_TE is not None, BLOCK=block,
        num_warps=min(max(block // 512, 1), 16), **launch(pdl_on(x_TE)))
    return out, res_out


@triton.jit
def silu_times(gate, up, dtype):
    """SiLU(gate) * up from half-precision tiles, rounded to `dtype` where the reference
    rounds (after the SiLU, after the product); the skinny product's gated prologue too."""
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_times(gate, up, out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _term_tile(t_ptr, b_ptr, rows, row_mask, cols, col_mask, stride_t, stride_b, t_col0,
               b_row0, RANK: tl.constexpr, RANK_PAD: tl.constexpr):
    """fp32 [rows, cols] tile of t[rows, t_col0 + r] @ B[b_row0 + cols, t_col0 + r]^T over the
    part's RANK columns (B is block-diagonal: the part's other columns are zero)."""
    ranks = tl.arange(0, RANK_PAD)
    rank_mask = ranks < RANK
    t = tl.load(t_ptr + rows[:, None] * stride_t + t_col0 + ranks[None, :],
                mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
    b = tl.load(b_ptr + (b_row0 + cols)[None, :] * stride_b + t_col0 + ranks[:, None],
                mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
    return tl.dot(t, b)


@triton.jit
def _silu_mul_term_kernel(x_ptr, t_ptr, b_ptr, out_ptr, n_rows, n_cols, stride_x, stride_t,
                          stride_b, stride_out, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    dtype = out_ptr.dtype.element_ty
    at = x_ptr + rows[:, None] * stride_x + cols[None, :]
    # y + t B^T rounded once, where the expand's GEMM (addmm) rounds
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32) + _term_tile(
        t_ptr, b_ptr, rows, row_mask, cols, col_mask, stride_t, stride_b, 0, 0, RANK, RANK_PAD)
    up = tl.load(at + n_cols, mask=mask, other=0.0).to(tl.float32) + _term_tile(
        t_ptr, b_ptr, rows, row_mask, cols, col_mask, stride_t, stride_b, RANK, n_cols, RANK,
        RANK_PAD)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             silu_times(gate.to(dtype), up.to(dtype), dtype), mask=mask)


@triton.jit
def _add_term_kernel(y_ptr, t_ptr, b_ptr, n_rows, n_cols, stride_y, stride_t, stride_b,
                     RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    at = y_ptr + rows[:, None] * stride_y + cols[None, :]
    # y + t B^T rounded once, where the expand's GEMM (addmm) rounds
    y = tl.load(at, mask=mask, other=0.0).to(tl.float32) + _term_tile(
        t_ptr, b_ptr, rows, row_mask, cols, col_mask, stride_t, stride_b, 0, 0, RANK, RANK_PAD)
    tl.store(at, y.to(y_ptr.dtype.element_ty), mask=mask)


TERM_ROWS = 16   # rows a term kernel's program takes: tl.dot wants each dimension >= 16


def _pad16(n: int) -> int:
    return max(triton.next_power_of_2(n), 16)


def add_term(y_TF: torch.Tensor, t_TR: torch.Tensor, b_FR: torch.Tensor) -> torch.Tensor:
    """y += t B^T in place: a LoRA expand of a few rows whose reader cannot add it (o, down:
    the next norm needs the whole row), cheaper a launch than cuBLAS's GEMM with an inner
    size of the rank (docs/PERF.md, "Decode with an adapter"); each program reads 2 KB of B
    (64 columns, rank 16). Unit column strides."""
    rows, cols = y_TF.shape
    rank = t_TR.shape[1]
    block = 64
    _add_term_kernel[(triton.cdiv(rows, TERM_ROWS), triton.cdiv(cols, block))](
        y_TF, t_TR, b_FR, rows, cols, y_TF.stride(0), t_TR.stride(0), b_FR.stride(0),
        RANK=rank, RANK_PAD=_pad16(rank), ROWS=TERM_ROWS, BLOCK=block, num_warps=4,
        **launch(pdl_on(y_TF)))
    return y_TF


def silu_mul(gate_up_T2I: torch.Tensor, term=None) -> torch.Tensor:
    """SiLU(first half) * second half of the last dim -> [T, I]; `term` (t [T, 2R], B [2I, 2R]
    block-diagonal, R): the adapter's t B^T added to gate_up first."""
    rows, width = gate_up_T2I.shape
    inter = width // 2
    out = gate_up_T2I.new_empty(rows, inter)
    if term is not None:
        t_TR, b_FR, rank = term
        block = 128   # 48 programs at one row on the 1.7B: each reads 8 KB of B (rank 16)
        _silu_mul_term_kernel[(triton.cdiv(rows, TERM_ROWS), triton.cdiv(inter, block))](
            gate_up_T2I, t_TR, b_FR, out, rows, inter, gate_up_T2I.stride(0), t_TR.stride(0),
            b_FR.stride(0), out.stride(0), RANK=rank, RANK_PAD=_pad16(rank), ROWS=TERM_ROWS,
            BLOCK=block, num_warps=4, **launch(pdl_on(gate_up_T2I)))
        return out
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up_T2I, out, inter, gate_up_T2I.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        **launch(pdl_on(gate_up_T2I)))
    return out


@triton.jit
def _norm_rope(x1, x2, w_ptr, cos, sin, halves, eps,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, dtype):
    """Per-head RMSNorm (optional) then rotate-half RoPE of a [heads, D2P] x 2 tile."""
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
        hmask = halves < HALF
        w1 = tl.load(w_ptr + halves, mask=hmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + halves, mask=hmask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    o1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    return o1, o2


@triton.jit
def _store_cache(cache_ptr, slot, stride_slot, heads, halves, mask, lo, hi, scale_ptr,
                 HALF: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_SCALES: tl.constexpr):
    row = cache_ptr + slot * stride_slot + heads[:, None] * HEAD_DIM + halves[None, :]
    if HAS_SCALES:
        inv = 1.0 / tl.load(scale_ptr)
        lo = tl.minimum(tl.maximum(lo.to(tl.float32) * inv, -FP8_MAX_F), FP8_MAX_F)
        hi = tl.minimum(tl.maximum(hi.to(tl.float32) * inv, -FP8_MAX_F), FP8_MAX_F)
    tl.store(row, lo.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(row + HALF, hi.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, pos_ptr, table_ptr, q_w_ptr, k_w_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale_ptr, v_scale_ptr, eps, stride_t, stride_table, stride_k_slot, stride_v_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr,
    HAS_SCALES: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    dtype = qkv_ptr.dtype.element_ty
    halves = tl.arange(0, HALF_PAD)
    hmask = halves < HALF
    pos = tl.load(pos_ptr + t)
    # The table is fp32; the reference casts cos/sin to the model dtype before multiplying.
    cos = tl.load(table_ptr + pos * stride_table + halves, mask=hmask, other=0.0)
    sin = tl.load(table_ptr + pos * stride_table + HALF + halves, mask=hmask, other=0.0)
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_t

    q_heads = tl.arange(0, HEADS_PAD)
    q_mask = (q_heads[:, None] < NUM_HEADS) & hmask[None, :]
    q_ptrs = row + q_heads[:, None] * HEAD_DIM + halves[None, :]
    q1 = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    q1, q2 = _norm_rope(q1, q2, q_w_ptr, cos, sin, halves, eps, HEAD_DIM, HALF, HAS_NORM, dtype)
    tl.store(q_ptrs, q1, mask=q_mask)
    tl.store(q_ptrs + HALF, q2, mask=q_mask)

    kv_heads = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (kv_heads[:, None] < NUM_KV_HEADS) & hmask[None, :]
    k_ptrs = row + NUM_HEADS * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + halves[None, :]
    k1 = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptrs + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k1, k2 = _norm_rope(k1, k2, k_w_ptr, cos, sin, halves, eps, HEAD_DIM, HALF, HAS_NORM, dtype)
    tl.store(k_ptrs, k1, mask=kv_mask)
    tl.store(k_ptrs + HALF, k2, mask=kv_mask)

    if STORE:
        slot = tl.load(slot_ptr + t)
        keep = kv_mask & (slot >= 0)  # padded rows (slot -1) write nothing
        v_ptrs = k_ptrs + NUM_KV_HEADS * HEAD_DIM
        v1 = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        v2 = tl.load(v_ptrs + HALF, mask=kv_mask, other=0.0)
        _store_cache(k_cache_ptr, slot, stride_k_slot, kv_heads, halves, keep, k1, k2,
                     k_scale_ptr, HALF, HEAD_DIM, HAS_SCALES)
        _store_cache(v_cache_ptr, slot, stride_v_slot, kv_heads, halves, keep, v1, v2,
                     v_scale_ptr, HALF, HEAD_DIM, HAS_SCALES)


@triton.jit
def _qk_norm_rope_store_term_kernel(
    qkv_ptr, t_ptr, b_ptr, pos_ptr, table_ptr, q_w_ptr, k_w_ptr, k_cache_ptr, v_cache_ptr,
    slot_ptr, k_scale_ptr, v_scale_ptr, n_rows, eps, stride_x, stride_t, stride_b,
    stride_table, stride_k_slot, stride_v_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    ROWS: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr, HAS_SCALES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """qk_norm_rope_store with the adapter's term, one program per (row tile, head): q heads,
    then k heads, then v heads, as the fused qkv output lays them out."""
    wait_for_previous(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    head = tl.program_id(1)
    dtype = qkv_ptr.dtype.element_ty
    halves = tl.arange(0, HALF_PAD)
    row_mask, hmask = rows < n_rows, halves < HALF
    mask = row_mask[:, None] & hmask[None, :]
    part = (head >= NUM_HEADS).to(tl.int32) + (head >= NUM_HEADS + NUM_KV_HEADS).to(tl.int32)
    col0 = head * HEAD_DIM
    ptrs = qkv_ptr + rows[:, None] * stride_x + col0 + halves[None, :]
    # y + t B^T rounded once, where the expand's GEMM (addmm) rounds
    x1 = (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + _term_tile(
        t_ptr, b_ptr, rows, row_mask, halves, hmask, stride_t, stride_b, part * RANK, col0,
        RANK, RANK_PAD)).to(dtype)
    x2 = (tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32) + _term_tile(
        t_ptr, b_ptr, rows, row_mask, halves, hmask, stride_t, stride_b, part * RANK,
        col0 + HALF, RANK, RANK_PAD)).to(dtype)
    if STORE:
        slot = tl.load(slot_ptr + rows, mask=row_mask, other=-1)[:, None]
    else:
        slot = rows[:, None]
    keep = mask & (slot >= 0)  # padded rows (slot -1) write nothing
    if part == 2:
        tl.store(ptrs, x1, mask=mask)
        tl.store(ptrs + HALF, x2, mask=mask)
        if STORE:
            kv_head = tl.zeros([1], tl.int32) + head - NUM_HEADS - NUM_KV_HEADS
            _store_cache(v_cache_ptr, slot, stride_v_slot, kv_head, halves, keep, x1, x2,
                         v_scale_ptr, HALF, HEAD_DIM, HAS_SCALES)
    else:
        pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)[:, None]
        cos = tl.load(table_ptr + pos * stride_table + halves[None, :], mask=mask, other=0.0)
        sin = tl.load(table_ptr + pos * stride_table + HALF + halves[None, :], mask=mask,
                      other=0.0)
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        if part == 0:
            o1, o2 = _norm_rope(f1, f2, q_w_ptr, cos, sin, halves, eps, HEAD_DIM, HALF,
                                HAS_NORM, dtype)
        else:
            o1, o2 = _norm_rope(f1, f2, k_w_ptr, cos, sin, halves, eps, HEAD_DIM, HALF,
                                HAS_NORM, dtype)
        tl.store(ptrs, o1, mask=mask)
        tl.store(ptrs + HALF, o2, mask=mask)
        if STORE and part == 1:
            kv_head = tl.zeros([1], tl.int32) + head - NUM_HEADS
            _store_cache(k_cache_ptr, slot, stride_k_slot, kv_head, halves, keep, o1, o2,
                         k_scale_ptr, HALF, HEAD_DIM, HAS_SCALES)


def qk_norm_rope_store(qkv_TX: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       positions_T: torch.Tensor, rope_LD: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                       slot_mapping_T: torch.Tensor | None = None,
                       k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, term=None) -> None:
    """In place on qkv [T, (H + 2K) * D]: q and k normed (when weights are given) and rotated;
    with caches, the new K/V are written at their slots (caches [N, S, K, D], contiguous).
    `term` (t [T, 3R], B [(H + 2K) * D, 3R] block-diagonal, R): the adapter's t B^T added to
    q, k and v first."""
    tokens = qkv_TX.shape[0]
    assert qkv_TX.stride(-1) == 1 and head_dim % 2 == 0, (qkv_TX.stride(), head_dim)
    store = k_cache is not None
    has_norm = q_weight is not None
    fp8 = store and k_scale is not None
    dummy = positions_T
    half = head_dim // 2
    pointers = (positions_T, rope_LD, q_weight if has_norm else dummy,
                k_weight if has_norm else dummy, k_cache if store else qkv_TX,
                v_cache if store else qkv_TX, slot_mapping_T if store else dummy,
                k_scale if fp8 else dummy, v_scale if fp8 else dummy)
    strides = (rope_LD.stride(0), k_cache.stride(1) if store else 0,
               v_cache.stride(1) if store else 0)
    flags = {"HAS_NORM": has_norm, "STORE": store, "HAS_SCALES": fp8}
    if term is not None:
        t_TR, b_FR, rank = term
        grid = (triton.cdiv(tokens, TERM_ROWS), num_heads + 2 * num_kv_heads)
        _qk_norm_rope_store_term_kernel[grid](
            qkv_TX, t_TR, b_FR, *pointers, tokens, eps, qkv_TX.stride(0), t_TR.stride(0),
            b_FR.stride(0), *strides, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim, HALF=half, HALF_PAD=_pad16(half), RANK=rank,
            RANK_PAD=_pad16(rank), ROWS=TERM_ROWS, **flags, num_warps=4,
            **launch(pdl_on(qkv_TX)))
        return
    _qk_norm_rope_store_kernel[(tokens,)](
        qkv_TX, *pointers, eps, qkv_TX.stride(0), *strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), **flags, num_warps=4, **launch(pdl_on(qkv_TX)))
