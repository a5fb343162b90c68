"""Which BLAS library runs a decode step's matrix products, chosen per ladder size at start.

    with blas_library("cublaslt"):
        ...                                      # every GEMM launched here goes through cuBLASLt
    choice, ms = choose_libraries(sizes, time_step)   # {size: library}, {size: {library: ms}}

A decode step's GEMMs are skinny (M = the batch, 1-256 rows) and read every weight once: the
HBM floor is the weights' bytes. cuBLAS's heuristics pick, per (M, N, K), kernels that add a
split-K reduction at small M; profiled in the decode graphs (2026-12-04) they reached 60-72%
of the bandwidth. cuBLASLt has its own heuristics and kernels for the same shapes. Neither is better everywhere,
so `rollout.decode_gemm=auto` times one whole decode step (the model, the LM head, the
sampler) at each ladder size under each library and captures that size's graphs under the
faster one; the default is cuBLAS: on an H200 (2026-12-05, Qwen3-1.7B shape) the two took
the same device time within 0.3% at every size from 1 to 256 rows, and auto costs the
engine's start about 5 s. The choice is PyTorch's own switch
(`torch.backends.cuda.preferred_blas_library`), set around the decode step only and restored
after, so the trainer's GEMMs keep the default. CUDA only: a CPU run has nothing to choose.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Callable, Iterator, Sequence

import torch

BLAS_LIBRARIES = ("cublas", "cublaslt")   # the first is PyTorch's default: kept on a tie
TIE_MARGIN = 0.02                          # another library must be 2% faster to be chosen
_SLEEP_CYCLES = 40_000_000                 # ~20 ms of a GPU busy while the host queues a step
_CYCLES_PER_SECOND = 2.0e9                 # above any data-center card's clock: sleeps long
# A CUDA error that poisons the context is not one library's failure (torch >= 2.8 names it).
_STICKY = getattr(torch, "AcceleratorError", ())


@contextlib.contextmanager
def blas_library(name: str | None) -> Iterator[None]:
    """GEMMs launched inside run through `name` ("cublas" or "cublaslt"; None: unchanged);
    the previous preference is restored after, also on an error."""
    if name is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def choose_libraries(sizes: Sequence[int], time_step: Callable[[int, str], float],
                     libraries: Sequence[str] = BLAS_LIBRARIES
                     ) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
    """({size: the fastest library}, {size: {library: seconds}}) from `time_step(size,
    library)`. A library whose step raises is left out at that size; the first library is kept
    unless another is TIE_MARGIN faster (timing noise does not flip a choice)."""
    choice, seconds = {}, {}
    for size in sizes:
        times = {}
        for library in libraries:
            try:
                times[library] = time_step(size, library)
            except (torch.OutOfMemoryError, _STICKY):
                raise
            except RuntimeError as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                warnings.warn(f"decode GEMMs through {library} failed at batch {size} ({first}): "
                              "that size uses the other library", stacklevel=2)
                continue
        if not times:
            raise RuntimeError(f"no BLAS library ran the decode step of batch {size}")
        best = min(times, key=times.get)
        default = libraries[0]
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
