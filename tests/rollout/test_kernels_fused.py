"""The fused layer kernels (handoff.rollout.kernels.fused) against the plain-torch reference
(handoff.rollout.ops on CPU tensors takes the reference path).

CPU: the kernels run under TRITON_INTERPRET=1 in ONE subprocess (the variable must be set before
Triton decorates them). CUDA (`-m cuda`): the same cases in bf16 on the GPU, where ops takes the
fused path, against the reference computed on CPU copies. Every case draws fresh inputs; caches
start poisoned with NaN so a missed or stray write shows.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from triton_interpreter import results_under_interpreter

# name: (tokens, heads, kv heads, head_dim, qk norm, kv cache dtype or None, slots)
QKV_CASES = {
    "qwen3_norm_store": (3, 4, 2, 32, True, "model", [5, 17, 40]),
    "llama_no_norm": (2, 4, 4, 16, False, "model", [3, 9]),
    "head_dim24_padded_half": (2, 6, 2, 24, True, "model", [16, 33]),
    "padding_row_writes_nothing": (3, 2, 1, 32, True, "model", [7, -1, 20]),
    "fp8_cache_with_scales": (2, 4, 2, 32, True, "fp8", [12, 30]),
    "no_cache_profiling": (4, 4, 2, 32, True, None, None),
}
NUM_BLOCKS, BLOCK_SIZE = 4, 16


def _qkv_case(seed: int, case, dtype, device):
    from handoff.rollout.attention import AttnMeta, KVCache
    from handoff.rollout.layers import inverse_frequencies, rope_table

    tokens, heads, kv_heads, d, norm, cache, slots = case
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    table = rope_table(inverse_frequencies({"rope_theta": 10000.0}, d), 64)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    weights = [(1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) for _ in range(2)]
    meta = AttnMeta(is_prefill=True, kv=None)
    if cache is not None:
        cache_dtype = torch.float8_e4m3fn if cache == "fp8" else dtype
        shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, d)
        k_cache, v_cache = (torch.full(shape, float("nan")).to(cache_dtype) for _ in range(2))
        scales = ([torch.tensor(0.05)], [torch.tensor(0.02)]) if cache == "fp8" else (None, None)
        meta = AttnMeta(is_prefill=True, kv=KVCache([k_cache], [v_cache], *scales),
                        slot_mapping_T=torch.tensor(slots))

    def moved(t):
        return None if t is None else t.to(device)

    if device != "cpu" and meta.kv is not None:
        kv = meta.kv
        meta = AttnMeta(is_prefill=True, slot_mapping_T=moved(meta.slot_mapping_T), kv=KVCache(
            [moved(kv.k[0])], [moved(kv.v[0])],
            None if kv.k_scale is None else [moved(kv.k_scale[0])],
            None if kv.v_scale is None else [moved(kv.v_scale[0])]))
    args = (qkv.to(device), heads, kv_heads, d, positions.to(device), table.to(device),
            moved(weights[0]) if norm else None, moved(weights[1]) if norm else None, 1e-6,
            meta, 0)
    return args


def _compare_qkv(fused_fn, ref_fn, case, dtype, device, seed) -> dict:
    """Run both on identical inputs; report max |fused - ref| / max |ref| of q, k, v and of
    the cache rows written (fp8 caches compared in stored units)."""
    got_args = _qkv_case(seed, case, dtype, device)
    ref_args = _qkv_case(seed, case, dtype, "cpu")
    got = fused_fn(*got_args)
    ref = ref_fn(*ref_args)
    out = {name: _rel(g, r) for name, g, r in zip("qkv", got, ref)}
    meta_got, meta_ref = got_args[-2], ref_args[-2]
    if meta_ref.kv is not None:
        slots = [s for s in case[-1] if s >= 0]
        for name in ("k", "v"):
            g = getattr(meta_got.kv, name)[0].float().cpu().flatten(0, 1)
            r = getattr(meta_ref.kv, name)[0].float().flatten(0, 1)
            if meta_ref.kv.k_scale is not None:
                # e4m3 keeps 3 mantissa bits: a 1-ulp bf16 difference upstream may move a value
                # one e4m3 step; count the values further apart than that.
                step = torch.exp2(r[slots].abs().clamp(min=2 ** -6).log2().floor() - 3)
                far = (g[slots] - r[slots]).abs() > step * 1.01
                out[f"{name}_cache_mismatch"] = far.float().mean().item()
            else:
                out[f"{name}_cache"] = _rel(g[slots], r[slots])
            # Rows that no token owns (and the null block) stay untouched (NaN).
            untouched = [i for i in range(NUM_BLOCKS * BLOCK_SIZE) if i not in slots]
            out[f"{name}_untouched"] = bool(g[untouched].isnan().all())
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float().cpu(), ref.float().cpu()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _fused_qkv(*args):
    from handoff.rollout.kernels.fused import qk_norm_rope_store

    qkv, heads, kv_heads, d, pos, table, qw, kw, eps, meta, layer = args
    kv = meta.kv
    caches = () if kv is None else (kv.k[0], kv.v[0], meta.slot_mapping_T)
    scales = {} if kv is None or kv.k_scale is None else {"k_scale": kv.k_scale[0],
                                                         "v_scale": kv.v_scale[0]}
    qk_norm_rope_store(qkv, heads, kv_heads, d, pos, table, qw, kw, eps, *caches, **scales)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.reshape(-1, heads, d), k.reshape(-1, kv_heads, d), v.reshape(-1, kv_heads, d)


def run_cases(device: str, dtype: torch.dtype, fused_qkv, fused_norm, fused_silu) -> dict:
    from handoff.rollout import ops

    results = {}
    for i, (name, case) in enumerate(QKV_CASES.items()):
        results[name] = _compare_qkv(fused_qkv, ops.qk_norm_rope_store, case, dtype, device, i)
    gen = torch.Generator().manual_seed(7)
    for name, (rows, cols, with_res) in {"add_norm_residual": (3, 48, True),
                                         "norm_first_layer": (2, 200, False)}.items():
        x, r = (torch.randn(rows, cols, generator=gen).to(dtype) for _ in range(2))
        w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype)
        ref = ops.add_rms_norm(x, r if with_res else None, w, 1e-6)
        got = fused_norm(x.to(device), r.to(device) if with_res else None, w.to(device), 1e-6)
        results[name] = {n: _rel(g, e) for n, g, e in zip(("out", "residual"), got, ref)}
    x = torch.randn(2, 2 * 1500, generator=gen).to(dtype) * 3
    got = fused_silu(x.to(device)).float().cpu()
    results["silu_mul"] = {"out": _rel(got, ops.silu_mul(x))}
    return results


def _interpreter_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from handoff.rollout.kernels import fused

    print("RESULTS " + json.dumps(run_cases("cpu", torch.float16, _fused_qkv,
                                            fused.add_rms_norm, fused.silu_mul)))


def _check(results: dict, tol: float, fp8_mismatch: float) -> None:
    """Relative errors within `tol` (an ulp or so of the model dtype); at most a fraction
    `fp8_mismatch` of fp8 cache values more than one e4m3 step from the reference."""
    for name, r in results.items():
        for key, value in r.items():
            if key.endswith("_untouched"):
                assert value, f"{name}: a cache row no token owns was written"
            elif key.endswith("_mismatch"):
                assert value <= fp8_mismatch, f"{name}/{key}: {value:.1%} of fp8 values differ"
            else:
                assert value <= tol, f"{name}/{key}: max |fused - ref| / max |ref| = {value}"


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__)


def test_fused_kernels_equal_reference_under_interpreter(interpreter_results):
    assert set(interpreter_results) == {*QKV_CASES, "add_norm_residual", "norm_first_layer",
                                        "silu_mul"}
    # fp16 rounding points are the reference's; only fp32 sum order differs (an ulp or so).
    # Triton 3.6's interpreter gets some fp8 conversions at a binade edge wrong (a value torch
    # rounds to -32 came out -16): ~1% of the values; the CUDA test checks the GPU's.
    _check(interpreter_results, tol=2e-3, fp8_mismatch=0.03)
    assert interpreter_results["padding_row_writes_nothing"]["k_untouched"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_kernels_equal_reference_on_cuda():
    from handoff.rollout import ops

    assert ops.use_fused(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    # bf16 on the GPU: ops dispatches to the kernels; the reference runs on CPU copies.
    results = run_cases("cuda", torch.bfloat16, ops.qk_norm_rope_store, ops.add_rms_norm,
                        ops.silu_mul)
    _check(results, tol=1e-2, fp8_mismatch=0.0)  # an ulp or so of bf16


if __name__ == "__main__":
    _interpreter_main()
