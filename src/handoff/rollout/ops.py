"""A decoder layer's ops in one place: its linears, and the elementwise ops between them.

Each elementwise op has the plain-torch reference (any device, any dtype) and, for bf16/fp16
tensors on CUDA, one fused Triton kernel (kernels/fused.py) that rounds where the reference
rounds. A linear is cuBLAS's, or under rollout.decode_gemm's "triton" (gemm_choice.py) a
decode step's skinny product in the Triton kernel (kernels/skinny.py). HANDOFF_FUSED=0 in the
environment forces the reference everywhere (A/B benches).

With a LoRA adapter, a fused column-parallel projection (q/k/v, gate/up) of a decode step
returns its product with the adapter's term still apart (PendingTerm): the fused kernel that
reads it next adds the term, so the term's product needs no launch of its own. o's and
down's reader, the next norm, needs the whole row (a norm kernel whose last column block
norms the row was slower; docs/log/2026-12-07-3-lora-term-in-its-reader.md): their terms
take a small Triton kernel of their own (LoraSlot.expand_into). HANDOFF_LORA_FOLD=0 adds
every term with cuBLAS's GEMM (A/B benches).

Shape legend: T = tokens, E = hidden size, H = query heads, K = KV heads, D = head dim,
I = intermediate size, L = RoPE table positions.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from handoff.rollout.attention import AttnMeta, store_kv
from handoff.rollout.gemm_choice import SKINNY_MAX_EXTRA_ROWS, SKINNY_MAX_ROWS, skinny_gemm_on


@functools.lru_cache(maxsize=None)
def fused_available() -> bool:
    """Whether the Triton kernels may run at all: triton importable, HANDOFF_FUSED not 0."""
    if os.environ.get("HANDOFF_FUSED", "1") == "0":
        return False
    try:
        import handoff.rollout.kernels.fused  # noqa: F401  (needs triton)
    except ImportError:
        return False
    return True


def use_fused(x: torch.Tensor) -> bool:
    """Whether `x` takes the fused kernels: CUDA, half precision, triton importable."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and fused_available()


@dataclass
class NormInput:
    """weight * RMSNorm(x + residual), not computed yet: the linear that reads it computes it
    (the skinny kernel, tile by tile, without a launch of its own) or has add_rms_norm make
    it first. Either way `residual_out` (x + residual, the stream; x without a residual) is
    set then, for the layer's next add."""

    x_TE: torch.Tensor
    residual_TE: torch.Tensor | None
    weight_E: torch.Tensor
    eps: float
    residual_out: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.x_TE.shape

    def materialize(self) -> torch.Tensor:
        normed_TE, self.residual_out = add_rms_norm(self.x_TE, self.residual_TE, self.weight_E,
                                                    self.eps)
        return normed_TE


# A decode step's rows up to which a LoRA term is left to the kernel that reads the product:
# those kernels read B once per 16 rows (kernels/fused.py), a prefill's thousands of rows
# would read it hundreds of times where the expand's GEMM reads it about once.
FOLD_MAX_ROWS = 128


@dataclass
class PendingTerm:
    """A LoRA linear's product y = x W^T (+ b) and its shrink t = x A^T, the term t B^T not
    added yet: qk_norm_rope_store and silu_mul add it as they read y; any other reader
    calls materialize()."""

    y_TF: torch.Tensor
    t_TR: torch.Tensor
    slot: object   # rollout.lora.LoraSlot

    @property
    def term(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(t, B, rank per part), as the fused kernels take it."""
        return self.t_TR, self.slot.B, self.slot.rank

    def materialize(self) -> torch.Tensor:
        return self.slot.expand_into(self.y_TF, self.t_TR)


def term_in_triton(x: torch.Tensor) -> bool:
    """Whether a LoRA term of these rows is the Triton kernels': a fused projection's waits
    for the kernel that reads it, o's and down's take kernels/fused.add_term (module doc)."""
    return use_fused(x) and term_fold_allowed(x.shape[0])


def term_fold_allowed(rows: int) -> bool:
    """Whether the LoRA term of a forward of `rows` rows is the Triton kernels' (folded into
    its reader, or kernels/fused.add_term), device aside: few rows, HANDOFF_LORA_FOLD not 0."""
    return rows <= FOLD_MAX_ROWS and os.environ.get("HANDOFF_LORA_FOLD", "1") != "0"


def linear(x_TE: torch.Tensor | NormInput | PendingTerm, weight_FE: torch.Tensor,
           bias_F: torch.Tensor | None = None, lora=None, *, gated: bool = False,
           fold_term: bool = False) -> torch.Tensor | PendingTerm:
    """x W^T + b, plus a LoRA slot's term (rollout/lora.py); `gated`: x is the MLP's
    [gate | up] and the input is silu_mul(x); a NormInput: the input is its norm. Under
    gemm_backend("triton") a product of <= SKINNY_MAX_ROWS rows (CUDA, half precision) is
    the Triton skinny kernel: the slot's shrink x A^T as more rows of the same launch, the
    SiLU or the norm made as x is read (HANDOFF_FUSED=0 turns it off: cuBLAS, as for a
    weight that is not row-major or not in x's dtype, or a slot past the kernel's extra rows).
    `fold_term`: the reader is a fused kernel that can add the slot's term (a PendingTerm
    comes back where term_in_triton says so)."""
    if isinstance(x_TE, PendingTerm):   # gate/up's product: silu_mul adds its term as it
        if _skinny(x_TE.y_TF, weight_FE, lora):   # reads, the skinny kernel's SiLU cannot
            x_TE = x_TE.materialize()
        else:
            x_TE, gated = silu_mul(x_TE), False
    pending = x_TE if isinstance(x_TE, NormInput) else None
    x = x_TE if pending is None else pending.x_TE
    fold = lora is not None and fold_term and term_in_triton(x)
    if _skinny(x, weight_FE, lora):
        from handoff.rollout.kernels.skinny import skinny_linear

        # the kernel takes dense tensors (a joined product's output is a strided view)
        x = x.contiguous()
        if pending is not None:
            pending.x_TE = x
        norm = None
        if pending is not None:
            res = pending.residual_TE
            pending.residual_out = x if res is None else torch.empty_like(x)
            norm = (res, pending.weight_E, pending.eps, pending.residual_out)
        y_TF, t_TR = skinny_linear(x, weight_FE, bias_F, None if lora is None else lora.A,
                                   gated=gated, norm=norm)
        if lora is None:
            return y_TF
        return PendingTerm(y_TF, t_TR, lora) if fold else lora.expand_into(y_TF, t_TR)
    if pending is not None:
        x_TE = pending.materialize()
    if gated:
        x_TE = silu_mul(x_TE)
    if fold:
        return PendingTerm(*lora.product(x_TE, weight_FE, bias_F), lora)
    return _plain_linear(x_TE, weight_FE, bias_F, lora)


def _skinny(x: torch.Tensor, weight_FE: torch.Tensor, lora) -> bool:
    """Whether the product x W^T (+ the slot's shrink) runs in the Triton skinny kernel."""
    return (skinny_gemm_on() and x.shape[0] <= SKINNY_MAX_ROWS and use_fused(x)
            and weight_FE.stride(-1) == 1 and weight_FE.dtype == x.dtype
            and (lora is None or lora.A.shape[0] <= SKINNY_MAX_EXTRA_ROWS))


def _plain_linear(x_TE: torch.Tensor, weight_FE: torch.Tensor, bias_F: torch.Tensor | None,
                  lora) -> torch.Tensor:
    return F.linear(x_TE, weight_FE, bias_F) if lora is None else lora.linear(x_TE, weight_FE,
                                                                              bias_F)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x), computed in fp32 and cast back before the weight (as HF does)."""
    if x.is_cuda:  # one fused kernel for the norm itself
        return weight * F.rms_norm(x, weight.shape, None, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x_TE: torch.Tensor, residual_TE: torch.Tensor | None, weight_E: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * RMSNorm(x + residual), x + residual); without a residual the sum is x."""
    if use_fused(x_TE):
        from handoff.rollout.kernels.fused import add_rms_norm as fused

        return fused(x_TE, residual_TE, weight_E, eps)
    summed = x_TE if residual_TE is None else x_TE + residual_TE
    return rms_norm(summed, weight_E, eps), summed


def silu_mul(gate_up_T2I: torch.Tensor | PendingTerm) -> torch.Tensor:
    """SiLU(gate) * up over the fused gate_up output [T, 2I] -> [T, I] (with its LoRA term
    added first where it is still pending)."""
    gate_up_T2I, term = _split_term(gate_up_T2I)
    if use_fused(gate_up_T2I):
        from handoff.rollout.kernels.fused import silu_mul as fused

        return fused(gate_up_T2I, term=term)
    gate_TI, up_TI = gate_up_T2I.chunk(2, dim=-1)
    return F.silu(gate_TI) * up_TI


def apply_rope(x_THD: torch.Tensor, cos_T1D2: torch.Tensor, sin_T1D2: torch.Tensor) -> torch.Tensor:
    """Rotate halves (HF `rotate_half` convention) by the positions' angles."""
    x1, x2 = x_THD.chunk(2, dim=-1)
    return torch.cat([x1 * cos_T1D2 - x2 * sin_T1D2, x2 * cos_T1D2 + x1 * sin_T1D2], dim=-1)


def _split_term(x: torch.Tensor | PendingTerm) -> tuple[torch.Tensor, tuple | None]:
    """(the product, its pending term for a fused kernel or None); the reference path adds
    the term here."""
    if not isinstance(x, PendingTerm):
        return x, None
    return (x.y_TF, x.term) if use_fused(x.y_TF) else (x.materialize(), None)


def qk_norm_rope_store(qkv_TX: torch.Tensor | PendingTerm, num_heads: int, num_kv_heads: int,
                       head_dim: int, positions_T: torch.Tensor, rope_LD: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       meta: AttnMeta, layer: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused qkv output into q [T, H, D], k, v [T, K, D]; norm q and k per head (when
    weights are given: Qwen3), rotate them, and write the new K/V into the layer's cache
    (when meta has one). The fused path works in place in qkv and returns views of it."""
    qkv_TX, term = _split_term(qkv_TX)
    tokens = qkv_TX.shape[0]
    kv = meta.kv
    k_scale = kv.k_scale[layer] if kv is not None and kv.k_scale is not None else None
    v_scale = kv.v_scale[layer] if kv is not None and kv.v_scale is not None else None
    if use_fused(qkv_TX):
        from handoff.rollout.kernels.fused import qk_norm_rope_store as fused

        fused(qkv_TX, num_heads, num_kv_heads, head_dim, positions_T, rope_LD, q_weight,
              k_weight, eps, *((kv.k[layer], kv.v[layer], meta.slot_mapping_T) if kv is not None else ()),
              k_scale=k_scale, v_scale=v_scale, term=term)
        q_TX, k_TX, v_TX = qkv_TX.split([num_heads * head_dim, num_kv_heads * head_dim,
                                         num_kv_heads * head_dim], dim=-1)
        return (q_TX.view(tokens, num_heads, head_dim), k_TX.view(tokens, num_kv_heads, head_dim),
                v_TX.view(tokens, num_kv_heads, head_dim))
    q_TX, k_TX, v_TX = qkv_TX.split([num_heads * head_dim, num_kv_heads * head_dim,
                                     num_kv_heads * head_dim], dim=-1)
    q_THD = q_TX.reshape(tokens, num_heads, head_dim)
    k_TKD = k_TX.reshape(tokens, num_kv_heads, head_dim)
    v_TKD = v_TX.reshape(tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q_THD, k_TKD = rms_norm(q_THD, q_weight, eps), rms_norm(k_TKD, k_weight, eps)
    cos_sin_TD = rope_LD[positions_T].to(qkv_TX.dtype)
    cos_T1D2, sin_T1D2 = cos_sin_TD[:, None, :].chunk(2, dim=-1)
    q_THD = apply_rope(q_THD, cos_T1D2, sin_T1D2)
    k_TKD = apply_rope(k_TKD, cos_T1D2, sin_T1D2)
    if kv is not None:
        store_kv(k_TKD, v_TKD, kv.k[layer], kv.v[layer], meta.slot_mapping_T, k_scale, v_scale)
    return q_THD, k_TKD, v_TKD
