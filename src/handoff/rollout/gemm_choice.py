"""Which GEMMs run a decode step's matrix products, chosen per ladder size at start.

    with gemm_backend("cublaslt"):
        ...                                      # every GEMM launched here goes through cuBLASLt
    choice, ms = choose_backends(sizes, time_step)    # {size: backend}, {size: {backend: ms}}

A decode step's GEMMs are skinny (M = the batch, 1-256 rows) and read every weight once: the
HBM floor is the weights' bytes. cuBLAS's heuristics pick, per (M, N, K), kernels that add a
split-K reduction at small M; profiled in the decode graphs (2026-12-04) they reached 60-72%
of the bandwidth. cuBLASLt has its own heuristics and kernels for the same shapes; "triton"
is our one-kernel skinny product (kernels/skinny.py) for steps of at most SKINNY_MAX_ROWS
rows, which also computes a LoRA slot's shrink in the same launch (cuBLAS for the rest of
such a step, and for every larger one). None is better everywhere, so
`rollout.decode_gemm=auto` times one whole decode step (the model, the LM head, the sampler)
at each ladder size under each backend that serves it and captures that size's graphs under
the fastest; the default is cuBLAS: on an H200 (2026-12-05, Qwen3-1.7B shape) cuBLAS and
cuBLASLt took the same device time within 0.3% at every size from 1 to 256 rows, and timing
the two cost the engine's start about 5 s (the Triton kernel's tuning adds its own:
`skinny_tune_s` in the engine's stats). cuBLAS or cuBLASLt is PyTorch's own switch
(`torch.backends.cuda.preferred_blas_library`); both it and the Triton switch are set around
the decode step only and restored after, so the trainer's GEMMs keep the default. CUDA only:
a CPU run has nothing to choose.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Callable, Iterator, Sequence

import torch

GEMM_BACKENDS = ("cublas", "cublaslt", "triton")   # the first is PyTorch's default: kept on a tie
SKINNY_MAX_ROWS = 32                       # the Triton skinny product's most rows
SKINNY_MAX_EXTRA_ROWS = 3 * 128            # its most extra rows (LoRA: q/k/v at rank 128)
TIE_MARGIN = 0.02                          # another backend must be 2% faster to be chosen
_SLEEP_CYCLES = 40_000_000                 # ~20 ms of a GPU busy while the host queues a step
_CYCLES_PER_SECOND = 2.0e9                 # above any data-center card's clock: sleeps long
# A CUDA error that poisons the context is not one backend's failure (torch >= 2.8 names it).
_STICKY = getattr(torch, "AcceleratorError", ())
_skinny_on = False                         # set by gemm_backend("triton"), read by ops.linear


def skinny_gemm_on() -> bool:
    """Whether GEMMs launched now take the Triton skinny product where it applies."""
    return _skinny_on


@contextlib.contextmanager
def gemm_backend(name: str | None) -> Iterator[None]:
    """GEMMs launched inside run through `name` ("cublas", "cublaslt", or "triton": the skinny
    kernel for products of <= SKINNY_MAX_ROWS rows, cuBLAS for the rest; None: unchanged);
    the previous setting is restored after, also on an error."""
    global _skinny_on
    if name is None:
        yield
        return
    before, skinny_before = torch.backends.cuda.preferred_blas_library(), _skinny_on
    torch.backends.cuda.preferred_blas_library("cublas" if name == "triton" else name)
    _skinny_on = name == "triton"
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)
        _skinny_on = skinny_before


def rows_padded(rows: int) -> int:
    """The rows the skinny kernel computes for `rows`: tl.dot's least (16), else the next
    power of two (compute is free at these sizes, bytes are not)."""
    return max(16, 1 << (rows - 1).bit_length())


def skinny_tuning_sizes(sizes: Sequence[int]) -> list[int]:
    """Ladder sizes whose decode steps give the skinny kernel every shape it will see: the
    largest size of each padded row count (the kernel's configs are chosen per padded rows)."""
    largest = {}
    for size in sorted(sizes):
        if size <= SKINNY_MAX_ROWS:
            largest[rows_padded(size)] = size
    return sorted(largest.values())


def backends_for(size: int, skinny: bool = True) -> tuple[str, ...]:
    """The backends a decode step of `size` rows can differ under (Triton only where its
    kernels may run, `skinny`, and up to SKINNY_MAX_ROWS: elsewhere the step would be
    cuBLAS's again)."""
    return GEMM_BACKENDS if skinny and size <= SKINNY_MAX_ROWS else GEMM_BACKENDS[:2]


def choose_backends(sizes: Sequence[int], time_step: Callable[[int, str], float],
                    backends: Callable[[int], Sequence[str]] = backends_for
                    ) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
    """({size: the fastest backend}, {size: {backend: seconds}}) from `time_step(size,
    backend)` over `backends(size)`. A backend whose step raises is left out at that size; the
    first is kept unless another is TIE_MARGIN faster (timing noise does not flip a choice)."""
    choice, seconds = {}, {}
    for size in sizes:
        times = {}
        candidates = backends(size)
        for backend in candidates:
            try:
                times[backend] = time_step(size, backend)
            except (torch.OutOfMemoryError, _STICKY):
                raise
            except Exception as e:   # a library's refusal, a Triton kernel that did not build
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                warnings.warn(f"decode GEMMs through {backend} failed at batch {size} ({first}): "
                              "that size uses another backend", stacklevel=2)
                continue
        if not times:
            raise RuntimeError(f"no GEMM backend ran the decode step of batch {size}")
        best = min(times, key=times.get)
        default = candidates[0]
        if default in times and times[best] > (1 - TIE_MARGIN) * times[default]:
            best = default
        choice[size], seconds[size] = best, times
    return choice, seconds


_MAX_SLEEP_CYCLES = 1_000_000_000          # ~0.5 s: a warm-up's one-off setup is not a step


def sleep_cycles(host_seconds: float) -> int:
    """GPU cycles of a sleep that outlasts the host queueing a step of `host_seconds` twice
    over (at least _SLEEP_CYCLES, at most _MAX_SLEEP_CYCLES)."""
    return min(max(_SLEEP_CYCLES, int(2 * host_seconds * _CYCLES_PER_SECOND)),
               _MAX_SLEEP_CYCLES)


def gpu_seconds(fn: Callable[[], None], device: torch.device, repeats: int = 3) -> float:
    """Device seconds of the kernels `fn` launches (the least of `repeats`, after one warm-up
    run): a sleep kernel keeps the GPU busy while the host queues them, so the host's launch
    gaps are not counted (a small model's eager step is launch-bound; its graph is not). The
    sleep is sized from the host time of a second warm-up run (the first may build kernels):
    a fixed 20 ms did not cover an eager 4B step on the device's slow host (2026-12-05: 5.3
    ms timed against 2.9 ms of kernels)."""
    with torch.cuda.device(device):   # the sleep and the events on the step's own device
        fn()   # the warm-up: one-off setup (kernel builds, workspaces) happens here
        torch.cuda.synchronize(device)
        queued = time.perf_counter()
        fn()
        queued = time.perf_counter() - queued
        torch.cuda.synchronize(device)
        cycles = sleep_cycles(queued)
        best = math.inf
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    return best
