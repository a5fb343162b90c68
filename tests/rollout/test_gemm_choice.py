"""rollout.decode_gemm: the GEMM backend of each ladder size's decode step, chosen by timing
(here with a stand-in timer: the device's is measured by `handoff bench engine`)."""

from __future__ import annotations

import pytest
import torch

from handoff.rollout.gemm_choice import (_SLEEP_CYCLES, SKINNY_MAX_EXTRA_ROWS,
                                         SKINNY_MAX_ROWS, TIE_MARGIN, backends_for,
                                         choose_backends, gemm_backend, rows_padded,
                                         skinny_gemm_on, skinny_tuning_sizes, sleep_cycles)

TWO = lambda size: ("cublas", "cublaslt")  # noqa: E731  (the two BLAS libraries alone)


def test_each_size_takes_the_faster_library_and_a_near_tie_keeps_the_default():
    ms = {1: {"cublas": 1.00, "cublaslt": 0.90},     # 10% faster: chosen
          32: {"cublas": 1.00, "cublaslt": 1.00 - TIE_MARGIN / 2},   # within the margin
          256: {"cublas": 0.80, "cublaslt": 1.20}}
    calls = []

    def time_step(size, library):
        calls.append((size, library))
        return ms[size][library]

    choice, seconds = choose_backends([1, 32, 256], time_step, TWO)
    assert choice == {1: "cublaslt", 32: "cublas", 256: "cublas"}
    assert seconds == ms and calls == [(b, lib) for b in (1, 32, 256)
                                       for lib in ("cublas", "cublaslt")]


def test_a_library_that_fails_at_a_size_is_left_out_there():
    def time_step(size, library):
        if library == "cublas" and size == 8:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return 1.0 if library == "cublas" else 2.0

    with pytest.warns(UserWarning, match="through cublas failed at batch 8"):
        choice, seconds = choose_backends([4, 8], time_step, TWO)
    assert choice == {4: "cublas", 8: "cublaslt"} and seconds[8] == {"cublaslt": 2.0}
    with pytest.raises(RuntimeError, match="batch 4"), pytest.warns(UserWarning):
        choose_backends([4], lambda size, library: (_ for _ in ()).throw(RuntimeError("no")))


def test_out_of_memory_is_not_taken_for_a_library_that_cannot_run():
    def time_step(size, library):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        choose_backends([1], time_step)


def test_the_triton_kernel_is_timed_only_where_it_serves_and_kept_when_faster():
    """At <= SKINNY_MAX_ROWS rows three backends are timed; above, the skinny kernel would
    leave the step to cuBLAS, so only the two libraries are."""
    assert backends_for(1) == backends_for(SKINNY_MAX_ROWS) == ("cublas", "cublaslt", "triton")
    assert backends_for(SKINNY_MAX_ROWS + 1) == ("cublas", "cublaslt")
    calls = []

    def time_step(size, backend):
        calls.append((size, backend))
        return {"cublas": 1.0, "cublaslt": 1.0, "triton": 0.7}[backend]

    above = 2 * SKINNY_MAX_ROWS
    choice, seconds = choose_backends([1, SKINNY_MAX_ROWS, above], time_step)
    assert choice == {1: "triton", SKINNY_MAX_ROWS: "triton", above: "cublas"}
    assert [b for s, b in calls if s == above] == ["cublas", "cublaslt"]
    assert set(seconds[SKINNY_MAX_ROWS]) == {"cublas", "cublaslt", "triton"}


def test_without_the_triton_kernels_auto_times_the_two_libraries_alone():
    assert backends_for(1, skinny=False) == ("cublas", "cublaslt")


def test_the_kernel_is_tuned_once_per_padded_row_count_at_the_largest_size():
    """Configs are chosen per padded rows (16 or 32): the start tunes the largest ladder
    size of each, whose steps give the kernel every shape it will see, and no other."""
    assert [rows_padded(r) for r in (1, 15, 16, 17, 32)] == [16, 16, 16, 32, 32]
    assert skinny_tuning_sizes([1, 2, 4, 8, 16, 32, 48, 64]) == [16, 32]
    assert skinny_tuning_sizes([1, 2, 4, 8]) == [8]       # max_num_seqs 8: no size 16
    assert skinny_tuning_sizes([1, 2, 4, 8, 16, 24]) == [16, 24]
    assert skinny_tuning_sizes([48, 64]) == []


def test_a_kernel_that_does_not_build_is_left_out_like_a_library():
    class KernelBuildError(Exception):   # Triton's compile errors are not RuntimeErrors
        pass

    def time_step(size, backend):
        if backend == "triton":
            raise KernelBuildError("out of resource: shared memory")
        return 1.0

    with pytest.warns(UserWarning, match="through triton failed at batch 1"):
        choice, seconds = choose_backends([1], time_step)
    assert choice == {1: "cublas"} and set(seconds[1]) == {"cublas", "cublaslt"}


def test_the_switches_are_set_inside_and_restored_after_also_on_an_error():
    before = torch.backends.cuda.preferred_blas_library()
    with gemm_backend(None):
        assert torch.backends.cuda.preferred_blas_library() == before and not skinny_gemm_on()
    with pytest.raises(ValueError):
        with gemm_backend("cublas"):
            assert str(torch.backends.cuda.preferred_blas_library()).endswith("Cublas")
            raise ValueError("inside")
    assert torch.backends.cuda.preferred_blas_library() == before
    with gemm_backend("triton"):   # the skinny kernel, cuBLAS for whatever it does not serve
        assert skinny_gemm_on()
        assert str(torch.backends.cuda.preferred_blas_library()).endswith("Cublas")
        with gemm_backend("cublas"):
            assert not skinny_gemm_on()
        assert skinny_gemm_on()
    assert not skinny_gemm_on() and torch.backends.cuda.preferred_blas_library() == before


def test_the_timing_sleep_outlasts_the_host_queueing_the_step():
    """A step the host takes 50 ms to queue gets a sleep of twice that at 2 GHz; a fast
    one keeps the floor (2026-12-05: a fixed sleep let an eager 4B step's launch gaps in)."""
    assert sleep_cycles(0.0) == sleep_cycles(0.001) == _SLEEP_CYCLES
    assert sleep_cycles(0.050) == 200_000_000
    assert sleep_cycles(0.100) == 2 * sleep_cycles(0.050)
    assert sleep_cycles(10.0) == sleep_cycles(1.0) < 2 * sleep_cycles(0.2)   # capped


def test_the_default_is_cublas_and_auto_is_asked_for():
    from handoff.config import load_config

    assert load_config(None, []).rollout.decode_gemm == "cublas"
    assert load_config(None, ["rollout.decode_gemm=auto"]).rollout.decode_gemm == "auto"
    assert load_config(None, ["rollout.decode_gemm=triton"]).rollout.decode_gemm == "triton"


def test_a_cpu_engine_chooses_nothing(qwen3_dir, ref):
    from handoff.rollout.engine import Engine

    engine = Engine(str(qwen3_dir), ref.cfg(decode_gemm="auto"))
    stats = engine.stats()
    assert stats["decode_gemm"] == {} and stats["decode_gemm_ms"] == {}
    engine.sleep(2)


@pytest.mark.parametrize("tp_size,named,want", [(1, "auto", "auto"), (2, "auto", "cublas"),
                                                (2, "cublaslt", "cublaslt")])
def test_tensor_parallel_ranks_do_not_time_a_choice_of_their_own(tp_size, named, want):
    """TP ranks that chose apart could fall out of step in their collectives: under TP,
    auto keeps cuBLAS (a named library is kept)."""
    from handoff.plan.shapes import PRESETS
    from handoff.rollout.models import build_model, spec_from_hf_config
    from handoff.rollout.parallel import TPGroup
    from handoff.rollout.runner import ModelRunner

    model = build_model(spec_from_hf_config(PRESETS["tiny-qwen3"]), device=torch.device("cpu"),
                        dtype=torch.float32, tp=TPGroup(rank=0, size=tp_size))
    runner = ModelRunner(model, device=torch.device("cpu"), block_size=4,
                         kv_dtype=torch.float32, decode_gemm=named)
    assert runner.decode_gemm == want


def test_decode_linears_route_to_the_kernel_only_where_it_serves(monkeypatch):
    """ops.linear with a stand-in kernel (the kernel itself: test_kernels_skinny.py): under
    gemm_backend("triton") a product of <= SKINNY_MAX_ROWS rows with a row-major weight of
    x's dtype goes to it, with the LoRA slot's A as its extra rows (at most
    SKINNY_MAX_EXTRA_ROWS) and the expand after, a
    pending norm with its residual and the stream's buffer; everything else is F.linear's,
    a gated input through silu_mul first, a pending norm through add_rms_norm."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from handoff.rollout import ops
    from handoff.rollout.kernels import skinny
    from handoff.rollout.lora import LoraSlot

    calls = []

    def kernel(x, weight, bias, extra, *, gated, norm):
        calls.append((x.shape[0], extra is not None, gated, norm))
        t = None if extra is None else torch.ones(x.shape[0], extra.shape[0])
        return torch.zeros(x.shape[0], weight.shape[0]), t

    monkeypatch.setattr(ops, "use_fused", lambda x: True)
    monkeypatch.setattr(skinny, "skinny_linear", kernel)
    monkeypatch.setenv("HANDOFF_LORA_FOLD", "0")   # the expand stays addmm on these CPU tensors
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=gen)
    slot = LoraSlot(w, max_rank=2)
    slot.B.copy_(torch.randn(slot.B.shape, generator=gen))
    x = torch.randn(SKINNY_MAX_ROWS + 1, 4, generator=gen)
    with gemm_backend("triton"):
        got = ops.linear(x[:3], w, None, slot)
        assert calls == [(3, True, False, None)]
        assert torch.equal(got, torch.ones(3, slot.A.shape[0]) @ slot.B.T)   # the expand
        ops.linear(x[:2], w)
        ops.linear(torch.randn(1, 8, generator=gen), w, gated=True)
        assert calls[1:] == [(2, False, False, None), (1, False, True, None)]
        # A layer's norm left to the product: the kernel gets it and the stream's buffer.
        g = torch.randn(4, generator=gen)
        first, later = ops.NormInput(x[:2], None, g, 1e-6), ops.NormInput(x[:2], x[2:4], g, 1e-6)
        ops.linear(first, w)
        ops.linear(later, w)
        assert first.residual_out is first.x_TE           # no residual: the stream is x
        assert calls[3][3] == (None, g, 1e-6, first.x_TE)
        res, weight, eps, out = calls[4][3]
        assert res is later.residual_TE and out is later.residual_out and out.shape == (2, 4)
        calls.clear()
        want = F.linear(x, w)
        assert torch.equal(ops.linear(x, w), want)                         # too many rows
        column_major = w.T.contiguous().T
        assert torch.equal(ops.linear(x[:1], column_major), F.linear(x[:1], column_major))
        with pytest.raises(RuntimeError, match="dtype"):   # not x's dtype: F.linear's refusal
            ops.linear(x[:1], w.double())
        # a slot of more extra rows than the kernel's split slots hold: cuBLAS and the expand
        wide = LoraSlot(w, max_rank=SKINNY_MAX_EXTRA_ROWS + 1)
        wide.A.normal_(generator=gen)
        wide.B.normal_(generator=gen)
        unfused = F.linear(x[:3], w).addmm_(F.linear(x[:3], wide.A), wide.B.T)
        assert torch.equal(ops.linear(x[:3], w, None, wide), unfused)
    assert torch.equal(ops.linear(x[:3], w), F.linear(x[:3], w))          # outside: cuBLAS's
    assert calls == []
    monkeypatch.undo()   # the CPU's own silu_mul (the stand-in made every op "fused")
    gate_up = torch.randn(2, 8, generator=gen)
    assert torch.equal(ops.linear(gate_up, w, gated=True), F.linear(ops.silu_mul(gate_up), w))
    later = ops.NormInput(x[:2], x[2:4], g, 1e-6)      # elsewhere: add_rms_norm first
    normed, stream = ops.add_rms_norm(x[:2], x[2:4], g, 1e-6)
    assert torch.equal(ops.linear(later, w), F.linear(normed, w))
    assert torch.equal(later.residual_out, stream)
