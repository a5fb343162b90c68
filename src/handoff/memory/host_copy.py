"""Host-to-device copies done by the GPU's SMs, not its copy engines.

    copy_from_host(dst_cuda_u8, src_pinned_u8)   # a kernel reads the pinned source over PCIe

For about a second after a large region goes to sleep the copy engines run at half rate
(likely the driver clearing the pages it got back), while kernels run at full speed
(docs/PERF.md, "The colocated step"). The switch to training starts with such copies (the
actor's params, then the reference). A kernel that loads the pinned source through its
unified (UVA) address and stores it to the device takes the SMs' path instead. No library
offers a host-to-device copy that avoids the copy engines, hence this kernel.
"""

from __future__ import annotations

import functools

import torch

_BLOCK = 4096   # int32 words per program: 16 KiB, enough loads in flight to cover PCIe latency


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use (CPU-only installs never import triton here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)

    return copy_words


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (contiguous uint8, CUDA) <- src (contiguous uint8, pinned host), on the current
    stream, asynchronous like a non_blocking copy_."""
    nbytes = dst.numel()
    words = nbytes // 4 if dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0 else 0
    if words:
        _kernel()[(-(-words // _BLOCK),)](dst[:words * 4].view(torch.int32),
                                          src[:words * 4].view(torch.int32), words,
                                          BLOCK=_BLOCK, num_warps=8)
    if words * 4 < nbytes:   # the unaligned rest, a few bytes
        dst[words * 4:].copy_(src[words * 4:], non_blocking=True)
