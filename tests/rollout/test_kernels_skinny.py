"""The Triton skinny product (handoff.rollout.kernels.skinny) against a float32 reference.

CPU: the kernel runs under TRITON_INTERPRET=1 in ONE subprocess (this module's __main__),
fp16 (the interpreter's tl.dot mishandles bf16), with small blocks so that every case has
ragged edges: rows of the weight and of the extra not a multiple of BLOCK_N, K not one of
BLOCK_K, weights whose rows are strided (a view of a wider matrix), a gated input (the MLP's
[gate | up], SiLU(gate) * up made in the kernel). The configs are also compiled for sm_90
ahead of time (no GPU needed). CUDA (`-m cuda`): bf16
at a real model's shapes through the autotuner, the decode linears routed to it under
gemm_backend("triton") (a LoRA slot's shrink in the same launch), captured in a graph, and an
engine decoding with it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from triton_interpreter import fix_interpreter_loop_bounds, results_under_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# name: (rows M, out N, in K, extra rows R, bias, extra padding of each weight row, input):
# input "plain"; "gated" ([gate | up]); "normed" (weight * RMSNorm(x + residual)); "normed
# first" (a first layer's: no residual)
CASES = {
    "one_row_ragged_n_and_k": (1, 40, 72, 0, False, 0, "plain"),
    "sixteen_rows_with_bias": (16, 48, 64, 0, True, 0, "plain"),
    "lora_extra_rows": (3, 32, 48, 12, False, 0, "plain"),
    "strided_rows_bias_and_extra": (5, 35, 40, 20, True, 8, "plain"),
    "gated_input_with_extra": (4, 40, 56, 12, False, 0, "gated"),
    "twenty_rows_padded_to_32": (20, 24, 40, 12, True, 0, "plain"),
    "normed_with_residual_and_extra": (3, 40, 72, 12, False, 0, "normed"),
    "normed_first_layer_ragged_k": (2, 24, 40, 0, True, 0, "normed first"),
}
SMALL = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


def run_cases(device: str, dtype: torch.dtype, skinny_linear, config: dict | None) -> dict:
    results = {}
    gen = torch.Generator().manual_seed(5)
    from handoff.rollout import ops

    for name, (m, n, k, r, bias, pad, kind) in CASES.items():
        gated = kind == "gated"
        x = torch.randn(m, 2 * k if gated else k, generator=gen)
        w = torch.randn(n, k + pad, generator=gen)[:, :k] / k ** 0.5
        e = torch.randn(r, k + pad, generator=gen)[:, :k] / k ** 0.5 if r else None
        b = torch.randn(n, generator=gen) if bias else None
        half = [None if t_ is None else t_.to(device, dtype) for t_ in (x, w, b, e)]
        norm = stream = None
        if kind.startswith("normed"):
            res = None if kind == "normed first" else torch.randn(m, k, generator=gen).to(
                device, dtype)
            g = (1 + torch.randn(k, generator=gen) / 4).to(device, dtype)
            stream = half[0] if res is None else torch.empty_like(half[0])
            norm = (res, g, 1e-6, stream)
        y, t = skinny_linear(*half, gated=gated, norm=norm, config=config)
        x32, w32, b32, e32 = (None if t_ is None else t_.float().cpu() for t_ in half)
        result = {}
        if gated:   # silu_mul's reference: rounded after the SiLU and after the product
            gate, up = x32.chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate).to(dtype).float()
            x32 = (act * up).to(dtype).float()
        if norm is not None:   # add_rms_norm's reference on the CPU, in the same dtype
            normed, want_stream = ops.add_rms_norm(half[0].cpu(), None if res is None
                                                   else res.cpu(), g.cpu(), 1e-6)
            x32 = normed.float()
            result["stream_equal"] = torch.equal(stream.cpu(), want_stream)
        want_y = x32 @ w32.T + (0 if b32 is None else b32)
        results[name] = {"y_shape": list(y.shape), "y_err": _rel(y, want_y),
                         "t_shape": None if t is None else list(t.shape),
                         "t_err": None if t is None else _rel(t, x32 @ e32.T), **result}
    # The gated input bit for bit: silu_mul's own kernel, then the plain product.
    from handoff.rollout.kernels.fused import silu_mul

    gate_up = torch.randn(5, 96, generator=gen).to(device, dtype)
    w = (torch.randn(40, 48, generator=gen) / 7).to(device, dtype)
    e = (torch.randn(8, 48, generator=gen) / 7).to(device, dtype)
    fused = skinny_linear(gate_up, w, None, e, gated=True, config=config)
    apart = skinny_linear(silu_mul(gate_up), w, None, e, config=config)
    results["gated_equals_silu_mul_then_product"] = all(
        torch.equal(a, b) for a, b in zip(fused, apart))
    return results


def interpreted_results(skinny_linear) -> dict:
    """Every case whole (SMALL), with K split in 2, and in 4 (some splits then get no tile
    of K: their partial is zero; an extra's rows split too); then whether a split product
    leaves its counters at zero, gives the same bits twice, and the same weight rows with and
    without an extra."""
    from handoff.rollout.kernels.skinny import split_buffers

    results = {f"split {split}": run_cases("cpu", torch.float16, skinny_linear,
                                           {**SMALL, "BLOCK_K": 16, "SPLIT_K": split})
               for split in (2, 4)}
    results["whole"] = run_cases("cpu", torch.float16, skinny_linear, SMALL)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, 80, generator=gen).half()
    w = (torch.randn(50, 80, generator=gen) / 9).half()
    e = (torch.randn(12, 80, generator=gen) / 9).half()
    split = {**SMALL, "BLOCK_K": 16, "SPLIT_K": 4}
    first, again = (skinny_linear(x, w, None, e, config=split) for _ in range(2))
    results["counters_zero"] = not split_buffers(x.device)[1].any().item()
    results["split_repeats_bitwise"] = all(torch.equal(a, b) for a, b in zip(first, again))
    # the extra's rows are split as the weight's: the weight's rows come out the same bits
    # with or without them (a zero adapter gives the base's outputs)
    results["split_y_same_without_extra"] = torch.equal(
        first[0], skinny_linear(x, w, None, None, config=split)[0])
    whole_y, _ = skinny_linear(x, w, None, e, config=SMALL)
    results["split_differs_from_whole_by"] = _rel(first[0], whole_y.float())
    return results


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want).norm() / want.norm()).item()


def _check(results: dict) -> None:
    assert results.pop("gated_equals_silu_mul_then_product") is True
    assert set(results) == set(CASES)
    for name, r in results.items():
        m, n, _, extra, _, _, kind = CASES[name]
        assert r["y_shape"] == [m, n] and r["y_err"] < 2e-3, f"{name}: {r}"
        # x + residual, the residual stream, is add_rms_norm's bit for bit
        assert r.get("stream_equal", kind == "plain" or kind == "gated") is True, f"{name}: {r}"
        if extra:
            assert r["t_shape"] == [m, extra] and r["t_err"] < 2e-3, f"{name}: {r}"
        else:
            assert r["t_shape"] is None, f"{name}: {r}"


def test_skinny_product_equals_the_reference_under_interpreter():
    """Whole and split over K (the last split's program sums the partials in order)."""
    results = results_under_interpreter(__file__)
    for name in ("whole", "split 2", "split 4"):
        _check(results[name])
    assert results["counters_zero"] is True   # a captured graph replays from zero
    assert results["split_repeats_bitwise"] is True
    assert results["split_y_same_without_extra"] is True
    assert results["split_differs_from_whole_by"] < 2e-3


def test_more_rows_than_the_kernel_serves_are_refused():
    pytest.importorskip("triton")
    from handoff.rollout.gemm_choice import SKINNY_MAX_ROWS
    from handoff.rollout.kernels.skinny import skinny_linear

    with pytest.raises(AssertionError, match="rows"):
        skinny_linear(torch.zeros(SKINNY_MAX_ROWS + 1, 8), torch.zeros(4, 8), config=SMALL)


def test_every_config_builds_for_hopper_with_pipelined_loads():
    """Compiled ahead of time for sm_90 by Triton's own ptxas (no GPU), specialized as the JIT
    specializes a decode call (16-byte aligned pointers, strides and sizes divisible by 16):
    every autotuner config builds within the card's shared memory, and its loads are cp.async
    copies, pipelined over K (plain loads would keep one tile in flight per program)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from handoff.rollout.kernels.skinny import CONFIGS, _fitting, _skinny_kernel

    names = _skinny_kernel.arg_names
    const_names = ("HAS_BIAS", "GATED", "NORMED", "HAS_RESIDUAL", "M_PAD", "BLOCK_N",
                   "BLOCK_K", "SPLIT_K")
    pointers = {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    signature = {n: "constexpr" if n in const_names else pointers.get(n, "*bf16")
                 if n.endswith("_ptr") else "fp32" if n == "eps" else "i32" for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n not in const_names and n not in ("M", "R", "eps")}   # M, R: any count
    # (bias, gated, normed, residual): plain, biased, down_proj's, a layer's norm, the first's
    variants = ((False, False, False, False), (True, False, False, False),
                (False, True, False, False), (False, False, True, True),
                (False, False, True, False))
    qkv = {"N": 4096, "K": 2048}   # a Qwen3-1.7B qkv_proj: every split fits
    cases = [(config, m_pad, flags) for m_pad in (16, 32) for flags in variants
             for config in _fitting(CONFIGS, qkv, M_PAD=m_pad, GATED=flags[1],
                                    HAS_RESIDUAL=flags[3])
             if config.kwargs["SPLIT_K"] == 1]
    assert len(cases) >= 70   # the pruning leaves most configs to time at every size
    # split over K: its counting and summing epilogue, at the largest tiles' shared memory
    split = [(config, 32, flags) for flags in variants[2:4]
             for config in _fitting(CONFIGS, qkv, M_PAD=32, GATED=flags[1],
                                    HAS_RESIDUAL=flags[3]) if config.kwargs["SPLIT_K"] in (4, 8)]
    assert {c.kwargs["SPLIT_K"] for c, _, _ in split} == {4, 8}
    cases += split
    for config, m_pad, (bias, gated, normed, residual) in cases:
        src = ASTSource(fn=_skinny_kernel, signature=signature, attrs=aligned,
                        constexprs={"HAS_BIAS": bias, "GATED": gated, "NORMED": normed,
                                    "HAS_RESIDUAL": residual, "M_PAD": m_pad,
                                    **config.kwargs})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": config.num_warps,
                                         "num_stages": config.num_stages})
        assert kernel.metadata.shared <= 227 * 1024, (config, m_pad, kernel.metadata.shared)
        assert "cp.async" in kernel.asm["ptx"], f"{config}: loads not pipelined"
        if config.kwargs["SPLIT_K"] > 1:
            assert _counts_in_after_its_partial(kernel.asm["ptx"]), config


def _counts_in_after_its_partial(ptx: str) -> bool:
    """A split program's count-in (the acq_rel atomic, one thread) follows a barrier after its
    last global store (its threads' partials): else the program counting last could sum a
    partial that another thread of the counting program has not stored yet."""
    lines = ptx.splitlines()
    atom = next(i for i, line in enumerate(lines) if "atom.global.gpu.acq_rel.add" in line)
    store = max(i for i, line in enumerate(lines[:atom]) if "st.global" in line)
    return any("bar.sync" in line for line in lines[store:atom])


def test_tuned_configs_are_kept_apart_by_what_the_input_needs_in_shared_memory():
    """Layer 0's qkv_proj (norm, no residual) has every later qkv_proj's shape: a config
    chosen for one input tile may not fit two. The autotuner's key keeps them apart, and a
    config pruned for two inputs at that shape exists (else the key would not matter)."""
    pytest.importorskip("triton")
    from handoff.rollout.kernels.skinny import CONFIGS, _fitting, _tuned_kernel

    qkv = {"N": 4096, "K": 2048}
    one = _fitting(CONFIGS, qkv, M_PAD=32, GATED=False, HAS_RESIDUAL=False)
    two = _fitting(CONFIGS, qkv, M_PAD=32, GATED=False, HAS_RESIDUAL=True)
    assert set(two) < set(one)
    assert {"N", "K", "M_PAD", "GATED", "NORMED", "HAS_RESIDUAL"} <= set(_tuned_kernel.keys)
    assert "R" not in _tuned_kernel.keys   # with or without an adapter: one config


def test_k_is_split_only_where_each_split_streams_tiles_and_the_slots_hold_them():
    """Split-K where the weight has few column blocks and a long K; not for the LM head (its
    thousands of blocks fill the card and would pass the partials' slots)."""
    pytest.importorskip("triton")
    from handoff.rollout.kernels.skinny import CONFIGS, SPLIT_SLOTS, _fitting

    def splits(n, k):
        kept = _fitting(CONFIGS, {"N": n, "K": k}, M_PAD=16, GATED=False, HAS_RESIDUAL=False)
        for c in kept:   # every split's partials have a slot
            blocks = -(-n // c.kwargs["BLOCK_N"])
            assert c.kwargs["SPLIT_K"] == 1 or blocks * c.kwargs["SPLIT_K"] <= SPLIT_SLOTS
        return {c.kwargs["SPLIT_K"] for c in kept}

    assert splits(2048, 6144) == {1, 2, 4, 8}     # a 1.7B down_proj: 128 column blocks
    for c in _fitting(CONFIGS, {"N": 2048, "K": 6144}, M_PAD=16, GATED=False,
                      HAS_RESIDUAL=False):   # no part of K left without a tile
        tiles, split = -(-6144 // c.kwargs["BLOCK_K"]), c.kwargs["SPLIT_K"]
        assert (split - 1) * -(-tiles // split) < tiles, c
    assert not any(c.kwargs["SPLIT_K"] == 8 and c.kwargs["BLOCK_K"] == 512   # 12 tiles: 2 x 6
                   for c in _fitting(CONFIGS, {"N": 2048, "K": 6144}, M_PAD=16, GATED=False,
                                     HAS_RESIDUAL=False))
    assert splits(151936, 2048) == {1}            # the LM head
    assert splits(2048, 128) == {1}               # K too short to split


@pytest.mark.cuda
@cuda
def test_skinny_product_on_cuda_through_the_autotuner():
    from handoff.rollout.kernels.skinny import skinny_linear

    from handoff.rollout.kernels.skinny import split_buffers

    for split in (1, 2, 4):   # the counting epilogue on the card's atomics too
        _check(run_cases("cuda", torch.bfloat16, skinny_linear,
                         {**SMALL, "BLOCK_K": 16, "SPLIT_K": split}))
    assert not split_buffers(torch.device("cuda", torch.cuda.current_device()))[1].any()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 2, 7, 16, 21, 32):   # a Qwen3-1.7B qkv_proj, a rank-16 slot on its 3 parts
        x = torch.randn(m, 2048, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(4096, 2048, device="cuda", generator=gen) / 45).bfloat16()
        a = (torch.randn(48, 2048, device="cuda", generator=gen) / 45).bfloat16()
        y, t = skinny_linear(x, w, None, a)
        assert _rel(y, x.float().cpu() @ w.float().cpu().T) < 1e-2
        assert _rel(t, x.float().cpu() @ a.float().cpu().T) < 1e-2


@pytest.mark.cuda
@cuda
def test_decode_linears_take_the_kernel_under_triton_and_it_captures():
    """ops.linear under gemm_backend("triton"): at <= SKINNY_MAX_ROWS rows the kernel (the
    slot's shrink in its launch, then the expand), the same result as cuBLAS's path; above,
    cuBLAS's own."""
    from handoff.rollout import ops
    from handoff.rollout.gemm_choice import SKINNY_MAX_ROWS, gemm_backend
    from handoff.rollout.lora import LoraSlot

    w = (torch.randn(1024, 512, device="cuda") / 23).bfloat16()
    slot = LoraSlot(w, max_rank=8)
    slot.A.copy_(torch.randn_like(slot.A) / 23)
    slot.B.copy_(torch.randn_like(slot.B) / 3)
    from handoff.rollout.kernels.skinny import skinny_linear

    for m in (1, 16, 20, SKINNY_MAX_ROWS + 1):
        for gated in (False, True):   # gated: x is [gate | up], the input silu_mul(x)
            x = torch.randn(m, 1024 if gated else 512, device="cuda").bfloat16()
            want = ops.linear(x, w, None, slot, gated=gated)
            with gemm_backend("triton"):
                got = ops.linear(x, w, None, slot, gated=gated)
            assert _rel(got, want.float().cpu()) < 1e-2
            if m > SKINNY_MAX_ROWS:
                assert torch.equal(got, want)   # cuBLAS's path, bit for bit
            else:                               # the kernel's, bit for bit
                y, t = skinny_linear(x, w, None, slot.A, gated=gated)
                assert torch.equal(got, slot.expand_into(y, t))
        # A layer's norm left to the product: close to add_rms_norm + cuBLAS, the same stream
        x, res = (torch.randn(m, 512, device="cuda").bfloat16() for _ in range(2))
        g = (1 + torch.randn(512, device="cuda") / 4).bfloat16()
        apart = ops.NormInput(x, res, g, 1e-6)
        want = ops.linear(apart, w, None, slot)
        fused = ops.NormInput(x, res, g, 1e-6)
        with gemm_backend("triton"):
            got = ops.linear(fused, w, None, slot)
        assert _rel(got, want.float().cpu()) < 1e-2
        assert torch.equal(fused.residual_out, apart.residual_out)
    x = torch.randn(4, 512, device="cuda").bfloat16()
    out = torch.empty(4, 1024, device="cuda", dtype=torch.bfloat16)
    with gemm_backend("triton"):
        eager = ops.linear(x, w, None, slot)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out.copy_(ops.linear(x, w, None, slot))   # a warm-up on the capture stream
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            out.copy_(ops.linear(x, w, None, slot))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)



@pytest.mark.cuda
@cuda
def test_an_engine_tunes_the_kernel_at_start_and_never_in_a_step(qwen3_dir, ref):
    """rollout.decode_gemm=triton: the configs are chosen while the engine starts (each
    linear and the head at each padded row count); its decode steps then launch the kernel
    and tune nothing."""
    from handoff.rollout.engine import Engine
    from handoff.rollout.kernels import skinny
    from handoff.rollout.sampling import SamplingParams

    # Decode without graphs (still padded to the ladder): every product is a Python call.
    engine = Engine(str(qwen3_dir), ref.cfg(num_blocks=512, block_size=16, max_num_seqs=32,
                                            decode_gemm="triton", cuda_graphs=False),
                    dtype="bfloat16")
    tuned = dict(skinny._tuned_kernel.cache)
    assert engine.stats()["skinny_tune_s"] > 0 and tuned
    calls = []
    real = skinny.skinny_linear

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    skinny.skinny_linear = counted
    try:
        prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + i)] for i in range(3)]
        engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    finally:
        skinny.skinny_linear = real
    assert calls and max(calls) <= 32
    assert dict(skinny._tuned_kernel.cache) == tuned   # no step tuned
    engine.sleep(2)

if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, os.path.dirname(__file__))
    fix_interpreter_loop_bounds()
    from handoff.rollout.kernels.skinny import skinny_linear

    print("RESULTS " + json.dumps(interpreted_results(skinny_linear)))
