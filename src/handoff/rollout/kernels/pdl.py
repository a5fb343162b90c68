"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's small kernels.

A decode step at small batch is ~300 kernels of a few microseconds each (the 1.7B at batch 1:
1.50 ms of kernels in a 1.82 ms step, docs/PERF.md), and between two dependent kernels the
card drains the first before it schedules the second. Launched with PDL, a kernel's programs
are scheduled as the one before it finishes, and each waits (`griddepcontrol.wait`, the first
thing it does) until that kernel is done and its writes are visible: the launch overlaps the
previous kernel's tail instead of following it. Nothing is read before the wait, so results
are those of a plain launch.

The kernels between a layer's products take it: add_rms_norm, silu_mul, qk_norm_rope_store,
paged decode and its merge, and with a LoRA adapter the term kernels (fused.py); cuBLAS's
products launch as before. Triton launches a kernel with it (`launch_pdl`) and emits the
wait (`gdc_wait`); this module says when to. HANDOFF_PDL=1 turns it on (sm_90+ CUDA
tensors); off by default until the engine's decode is measured with and without it in one
call.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:   # a Triton without it leaves PDL off, not the kernels that take the flag
    from triton.language.extra.cuda import gdc_wait
except ImportError:
    gdc_wait = None


def hopper(device: torch.device) -> bool:
    """A CUDA device of sm_90 or newer: PDL and the bulk L2 prefetch (prefetch.py) exist."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels reading `t` launch with PDL: HANDOFF_PDL=1 and a sm_90+ CUDA tensor.
    Read at each launch: graphs captured already keep the launches they were captured with."""
    return (os.environ.get("HANDOFF_PDL", "0") == "1" and gdc_wait is not None
            and hopper(t.device))


def launch(on: bool) -> dict:
    """The launch keywords of a kernel that takes `PDL: tl.constexpr`: its flag and Triton's
    launch option."""
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A kernel's first statement: under PDL, wait until the kernel before it is done."""
    if PDL:
        gdc_wait()
