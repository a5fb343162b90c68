"""Decode's skinny matrix products (at most 32 rows) in one Triton kernel, LoRA's shrink beside.

    y_MN, t_MR = skinny_linear(x_MK, weight_NK, bias_N, extra_RK)   # t is None without extra

At decode's batch sizes a linear reads every weight once and computes almost nothing: its
floor is the weight's bytes at the copy rate. cuBLAS reached 62% of it on the Qwen3-1.7B
shape at batch 1 (H200, 2026-12-05: split-K kernels and a reduce kernel per product). Here a
program owns BLOCK_N rows of the weight over 1 / SPLIT_K of K; x (32 rows at most, padded to
16 or 32 for the tensor-core dot) is re-read from L2 by every program, so its tile stays no
larger than the weight's (more rows would read x more than the weight: cuBLAS's). With
SPLIT_K > 1 each program stores its fp32 partial and counts in on its column block's
counter; the one that counts last sums the partials in split order (the same bits at every
run) and writes y: no reduce kernel. `extra_RK` (a LoRA slot's stacked A, rollout/lora.py)
is read as R more rows of the same product into `t` (at most SKINNY_MAX_EXTRA_ROWS), split
over K as the weight is: LoRA's shrink x A^T takes no launch of its own. With `gated` the
input is the MLP's [gate | up] and each tile of SiLU(gate) * up is made as it is read
(silu_mul's rounding): down_proj takes no silu_mul launch. With `norm` the input is a
layer's weight * RMSNorm(x + residual): every program first sums its rows' squares over K
(16-32 rows, from L2), then makes each tile as it reads it; column block 0 writes x +
residual, the residual stream: qkv_proj and gate_up_proj take no add_rms_norm launch
(ops.NormInput). (Split over K, each part still sums the squares over
all of K: x's reads from L2 grow with the split, which the autotuner's timing weighs.)
cuBLAS offers neither a reduce inside the product, nor a second weight or a prologue in one
call, hence a kernel of our own.

Triton's autotuner picks BLOCK_N / BLOCK_K / SPLIT_K / stages per (N, K, padded rows, the
input's kind), each config timed with the weight coming from HBM, and keeps the choice on
disk (a second start does not tune again); the runner tunes every shape at start, before any
step. Why K is split: measured on the H200 (2026-12-05) without it, a product of N / BLOCK_N
<= 132 programs (a 2048-wide o_proj or down_proj) held one program an SM with 12-32 KB of
weight in flight, a third of what the copy rate needs, and the kernel ran 1.6-1.8x slower
than cuBLAS. Whether a decode step uses this kernel at all is rollout.decode_gemm's choice,
timed per batch size with `auto` (rollout/gemm_choice.py).

Shape legend: M = rows (tokens), K = in features, N = out features, R = extra rows (LoRA's
parts x rank).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from handoff.rollout.gemm_choice import SKINNY_MAX_EXTRA_ROWS, SKINNY_MAX_ROWS, rows_padded
from handoff.rollout.kernels.fused import silu_times

BASE_CONFIGS = ((16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4),
                (32, 256, 4, 3), (32, 256, 8, 4), (64, 128, 4, 3), (64, 64, 4, 4))
SPLITS = (1, 2, 4, 8)
CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split}, num_warps=w,
                         num_stages=s)
           for n, k, w, s in BASE_CONFIGS for split in SPLITS]
SHARED_BYTES = 200 * 1024   # a config's pipeline buffers stay under the H100/H200's 227 KB
# Split-K's partial sums: one slot of [M_PAD, BLOCK_N] fp32 per (split, column block), at
# most SPLIT_SLOTS of them (8 MB) for the weight's blocks and EXTRA_SLOTS more for an
# extra's (a LoRA slot's, up to SKINNY_MAX_EXTRA_ROWS rows: the autotuner's key leaves
# the extra out, so a config chosen without one must fit with one), and a counter per column block;
# one pair per device, made before any graph is captured and reused by every launch
# (launches on a stream run one after another, and each leaves its counters at zero).
SPLIT_SLOTS = 1024
EXTRA_SLOTS = max(SPLITS) * (SKINNY_MAX_EXTRA_ROWS // 16)   # BLOCK_N >= 16
SLOT_FLOATS = SKINNY_MAX_ROWS * 64


def pipeline_bytes(config: triton.Config, m_pad: int, two_inputs: bool) -> int:
    """Shared memory of a config's pipelined x (and up, or the residual: `two_inputs`) and
    weight tiles, bf16, all stages: at most what Triton allocates (the tests check)."""
    x_rows = 2 * m_pad if two_inputs else m_pad
    return (x_rows + config.kwargs["BLOCK_N"]) * config.kwargs["BLOCK_K"] * 2 * config.num_stages


def split_fits(n: int, block_n: int, split: int, m_pad: int) -> bool:
    """Whether a product's split partials (N wide, `split` ways) fit the slots."""
    return split == 1 or (triton.cdiv(n, block_n) * split <= SPLIT_SLOTS
                          and block_n * m_pad <= SLOT_FLOATS)


def split_streams(k: int, block_k: int, split: int) -> bool:
    """Whether every one of `split` parts of K gets tiles to stream: the kernel gives each
    cdiv(tiles, split) of them, so the last parts can be left empty (still correct, a program
    spent on nothing); a split is kept where each part but the last has two tiles or more
    and the last has one or more."""
    tiles = triton.cdiv(k, block_k)
    per_split = triton.cdiv(tiles, split)
    return split == 1 or (per_split >= 2 and (split - 1) * per_split < tiles)


def _fitting(configs, named_args, **kwargs):
    # x's tiles grow with the rows: a config too large for shared memory is not timed; a
    # split is timed only where its parts all stream tiles and its partials fit the slots.
    two = kwargs["GATED"] or kwargs["HAS_RESIDUAL"]
    n, k, m_pad = named_args["N"], named_args["K"], kwargs["M_PAD"]
    return [c for c in configs
            if pipeline_bytes(c, m_pad, two) <= SHARED_BYTES
            and split_fits(n, c.kwargs["BLOCK_N"], c.kwargs["SPLIT_K"], m_pad)
            and split_streams(k, c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"])]


@triton.jit
def _summed(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, ks, mask, HAS_RESIDUAL: tl.constexpr):
    """fp32 [M_PAD, BLOCK_K] of x + residual rounded to x's dtype (the residual stream's)."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs_m[:, None] * stride_rm + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _skinny_kernel(x_ptr, r_ptr, g_ptr, s_ptr, w_ptr, e_ptr, b_ptr, y_ptr, t_ptr, ws_ptr,
                   cnt_ptr, M, N, R, K, stride_xm, stride_rm, stride_sm, stride_wn, stride_en,
                   stride_ym, stride_tm, eps, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                   NORMED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, M_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # Column blocks [0, cdiv(N, BLOCK_N)) are rows of the weight, the rest rows of the extra;
    # each block is split over K SPLIT_K ways, program `pid` taking block pid % blocks over
    # part pid // blocks. The source is chosen by scalars, so one pipelined loop (and one set
    # of buffers) serves both; an extra split as the weight is ends with it (unsplit, its
    # programs streamed all of K while the weight's streamed a part: 2.3x the base's step).
    pid = tl.program_id(0)
    weight_blocks = tl.cdiv(N, BLOCK_N)
    blocks = weight_blocks + tl.cdiv(R, BLOCK_N)
    any_block = pid % blocks
    split = pid // blocks
    own = any_block < weight_blocks
    block = tl.where(own, any_block, any_block - weight_blocks)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    src = tl.where(own, w_ptr, e_ptr)
    stride_src = tl.where(own, stride_wn, stride_en)
    num_rows = tl.where(own, N, R)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    r_ok = rows < num_rows
    src_rows = src + rows.to(tl.int64)[None, :] * stride_src
    dtype = x_ptr.dtype.element_ty
    if NORMED:   # each row's 1 / RMS of x + residual first: one pass over all K columns
        squares = tl.zeros((M_PAD,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            summed = _summed(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, ks,
                             m_ok[:, None] & (ks < K)[None, :], HAS_RESIDUAL)
            squares += tl.sum(summed * summed, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    acc = tl.zeros((M_PAD, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        mask = m_ok[:, None] & k_ok[None, :]
        if NORMED:   # weight * RMSNorm(x + residual), rounded where add_rms_norm rounds
            summed = _summed(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, ks, mask, HAS_RESIDUAL)
            if HAS_RESIDUAL:   # the residual stream for the next add: column block 0 of
                # each split writes its part of K
                tl.store(s_ptr + offs_m[:, None] * stride_sm + ks[None, :], summed.to(dtype),
                         mask=mask & own & (block == 0))
            normed = (summed * rstd[:, None]).to(dtype).to(tl.float32)
            g = tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = (normed * g[None, :]).to(dtype)
        else:
            x_tile = x_ptr + offs_m[:, None] * stride_xm + ks[None, :]
            x = tl.load(x_tile, mask=mask, other=0.0)
            if GATED:   # x holds [gate | up]: this tile's SiLU(gate) * up, as silu_mul rounds
                up = tl.load(x_tile + K, mask=mask, other=0.0)
                x = silu_times(x, up, dtype)
        w = tl.load(src_rows + ks[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc)     # w is the [BLOCK_K, BLOCK_N] tile of the rows, transposed
    finished = pid >= 0
    if SPLIT_K > 1:   # the split's partial to its slot; the block's last split to count in sums
        slot = ws_ptr + (split * blocks + any_block) * (M_PAD * BLOCK_N)
        tile = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(slot + tile, acc)
        tl.debug_barrier()   # every thread's partial stored before the count releases it
        finished = tl.atomic_add(cnt_ptr + any_block, 1, sem="acq_rel") == SPLIT_K - 1
        if finished:   # the partials in split order: the same sum at every run
            acc = tl.zeros((M_PAD, BLOCK_N), tl.float32)
            for part in range(SPLIT_K):
                acc += tl.load(ws_ptr + (part * blocks + any_block) * (M_PAD * BLOCK_N)
                               + tile, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + any_block, 0)   # zero for the next launch
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=r_ok & own, other=0.0).to(tl.float32)[None, :]
    dst = tl.where(own, y_ptr, t_ptr)
    stride_dst = tl.where(own, stride_ym, stride_tm)
    tl.store(dst + offs_m[:, None] * stride_dst + rows[None, :], acc.to(dst.dtype.element_ty),
             mask=m_ok[:, None] & r_ok[None, :] & finished)


_split_buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def split_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [(SPLIT_SLOTS + EXTRA_SLOTS) * SLOT_FLOATS] fp32, counters [SPLIT_SLOTS +
    EXTRA_SLOTS] int32 at zero) of `device`, made at its first product: the runner's
    tuning, before any capture. One pair serves every launch because they run one after
    another on one stream: two products launched on concurrent streams would share slots and
    counters (the engine decodes on one stream)."""
    if device not in _split_buffers:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
            "the skinny kernel's split buffers are made before a graph is captured (tune first)"
        slots = SPLIT_SLOTS + EXTRA_SLOTS
        _split_buffers[device] = (
            torch.empty(slots * SLOT_FLOATS, dtype=torch.float32, device=device),
            torch.zeros(slots, dtype=torch.int32, device=device))
    return _split_buffers[device]


def _from_hbm(kernel_call, quantiles):
    # Each timed call after a 256 MB write that evicts L2 (do_bench's own flush): a decode step
    # streams every weight from HBM, and a replay loop would leave a 50 MB weight in L2 and
    # pick the config for L2's bandwidth. The caller's queued work first: the benchmark's
    # writes into y and t must not race it.
    torch.cuda.current_stream().synchronize()
    return do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# Keyed by the weight's shape, the padded rows and the input's kind, not the extra rows: with
# or without an adapter a weight's rows take the same config, so a zero adapter's outputs are
# the base's bit for bit. The kind is in the key because it sets the shared memory a config
# needs (_fitting): layer 0's qkv_proj (no residual) shares its shape with every later one's.
_tuned_kernel = triton.autotune(configs=CONFIGS, key=["N", "K", "M_PAD", "GATED", "NORMED",
                                                      "HAS_RESIDUAL"], do_bench=_from_hbm,
                                prune_configs_by={"early_config_prune": _fitting},
                                cache_results=True)(_skinny_kernel)


def skinny_linear(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                  extra_RK: torch.Tensor | None = None, *, gated: bool = False,
                  norm: tuple | None = None, config: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x W^T + b [M, N], x E^T [M, R] or None) in one launch, both in x's dtype.

    M <= SKINNY_MAX_ROWS; weight and extra row-major (their rows may be strided). `gated`:
    x is [M, 2K], gate then up, and the product's input is SiLU(gate) * up (silu_mul's
    numbers), made tile by tile: the MLP's down_proj without silu_mul's launch. `norm`
    (residual [M, K] or None, norm weight [K], eps, residual_out [M, K]): the input is
    weight * RMSNorm(x + residual) (add_rms_norm's rounding, the sum of squares in another
    order) and x + residual goes to residual_out: a layer's norm without its own launch.
    `config` ({"BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"}; SPLIT_K 1 if
    left out) skips the autotuner."""
    rows, width = x_MK.shape
    in_features = width // 2 if gated else width
    assert rows <= SKINNY_MAX_ROWS, f"{rows} rows: the skinny kernel serves <= {SKINNY_MAX_ROWS}"
    assert not (gated and norm), "a gated input is not normed"
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    residual, norm_weight, eps, residual_out = norm or (None, None, 0.0, None)
    if residual is not None:
        assert residual.stride(-1) == 1 and residual_out.stride(-1) == 1
    assert weight_NK.stride(-1) == 1 and weight_NK.shape[1] == in_features
    out_features = weight_NK.shape[0]
    extra = 0 if extra_RK is None else extra_RK.shape[0]
    y = torch.empty(rows, out_features, dtype=x_MK.dtype, device=x_MK.device)
    t = None if extra_RK is None else torch.empty(rows, extra, dtype=x_MK.dtype,
                                                   device=x_MK.device)
    if extra_RK is not None:
        assert extra_RK.stride(-1) == 1 and extra_RK.shape[1] == in_features
        assert extra <= SKINNY_MAX_EXTRA_ROWS, \
            f"{extra} extra rows: the split slots hold {SKINNY_MAX_EXTRA_ROWS}"
    args = (x_MK, x_MK if residual is None else residual,
            x_MK if norm_weight is None else norm_weight,
            x_MK if residual_out is None else residual_out,
            weight_NK, weight_NK if extra_RK is None else extra_RK,
            weight_NK if bias_N is None else bias_N, y, y if t is None else t,
            *split_buffers(x_MK.device), rows, out_features, extra, in_features, x_MK.stride(0),
            0 if residual is None else residual.stride(0),
            0 if residual_out is None else residual_out.stride(0), weight_NK.stride(0),
            0 if extra_RK is None else extra_RK.stride(0), y.stride(0),
            0 if t is None else t.stride(0), float(eps))
    flags = {"HAS_BIAS": bias_N is not None, "GATED": gated, "NORMED": norm is not None,
             "HAS_RESIDUAL": residual is not None, "M_PAD": rows_padded(rows)}

    def grid(meta):
        return ((triton.cdiv(out_features, meta["BLOCK_N"]) + triton.cdiv(extra, meta["BLOCK_N"]))
                * meta["SPLIT_K"],)

    if config is None:
        _tuned_kernel[grid](*args, **flags)
    else:
        config = {"SPLIT_K": 1, **config}
        assert split_fits(out_features, config["BLOCK_N"], config["SPLIT_K"], flags["M_PAD"]), \
            f"{config}: the split's partials pass the {SPLIT_SLOTS} slots"
        _skinny_kernel[grid(config)](*args, **flags, **config)
    return y, t
