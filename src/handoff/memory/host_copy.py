"""Small and fast copies between host and device: by the GPU's SMs, not its copy engines,
where a copy must not queue behind others; otherwise without stalling the host.

    copy_from_host(dst_cuda_u8, src_pinned_u8)            # a kernel reads the pinned source
    results_to_host(tokens_host, logprobs_host, tokens_B, logprobs_B)   # a kernel writes them
    upload(host_array_or_tensor, device)                  # through kept pinned bytes

The copy engines serve each direction in the order copies were queued, whatever their
stream: a small copy queued behind a large set waits for the whole set (docs/PERF.md, "The
streamed switch"). And for about a second after a large region goes to sleep they run at
half rate (likely the driver clearing the pages it got back), while kernels run at full
speed. A kernel that loads or stores pinned host memory through its unified (UVA) address
takes the SMs' path instead: the switch's first copies back (the actor's params, the
reference) and the engine's per-step results (a few KB, which must not wait behind the
trainer's state going to the host under generation) go that way. No library offers a copy
that avoids the copy engines, hence these kernels.
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import torch

_BLOCK = 4096   # int32 words per program: 16 KiB, enough loads in flight to cover PCIe latency
_RESULTS_BLOCK = 1024   # rows per program of the results kernel (a step has <= a few hundred)


@functools.cache
def _kernels():
    """The Triton kernels, compiled on first use (CPU-only installs never import triton here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)

    @triton.jit
    def copy_words_on(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
        # a fixed number of programs, each looping over every num_programs-th block
        for block in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)

    @triton.jit
    def copy_results(tok_dst, lp_dst, tok_src, lp_src, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(tok_dst + offs, tl.load(tok_src + offs, mask=mask), mask=mask)
        tl.store(lp_dst + offs, tl.load(lp_src + offs, mask=mask), mask=mask)

    return copy_words, copy_results, copy_words_on


def copy_from_host(dst: torch.Tensor, src: torch.Tensor, *, programs: int | None = None) -> None:
    """dst (contiguous uint8, CUDA) <- src (contiguous uint8, pinned host), on the current
    stream, asynchronous like a non_blocking copy_. programs: run on that many programs (a
    few SMs, beside other work) instead of one per 16 KiB block (the whole card)."""
    nbytes = dst.numel()
    words = nbytes // 4 if dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0 else 0
    if words:
        blocks = -(-words // _BLOCK)
        kernel = _kernels()[0] if programs is None else _kernels()[2]
        kernel[(blocks if programs is None else min(programs, blocks),)](
            dst[:words * 4].view(torch.int32), src[:words * 4].view(torch.int32), words,
            BLOCK=_BLOCK, num_warps=8)
    if words * 4 < nbytes:   # the unaligned rest, a few bytes
        dst[words * 4:].copy_(src[words * 4:], non_blocking=True)


def results_to_host(tokens: torch.Tensor, logprobs: torch.Tensor, tokens_B: torch.Tensor,
                    logprobs_B: torch.Tensor) -> None:
    """Pinned host `tokens`, `logprobs` <- the step's CUDA `tokens_B`, `logprobs_B` (same
    length, dtypes and contiguity; one launch on the current stream, asynchronous: record
    an event after it and synchronize that before reading the host side)."""
    n = tokens_B.numel()
    assert tokens.numel() == logprobs.numel() == logprobs_B.numel() == n, "one row each"
    assert tokens.dtype == tokens_B.dtype and logprobs.dtype == logprobs_B.dtype
    if n:
        _kernels()[1][(-(-n // _RESULTS_BLOCK),)](tokens, logprobs, tokens_B.contiguous(),
                                                  logprobs_B.contiguous(), n,
                                                  BLOCK=_RESULTS_BLOCK, num_warps=4)


def upload(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or tensor on `device` without stalling the host, through pinned bytes
    this process keeps (`_Staging`): a pageable host-to-device copy waits for the copy's
    staging, and pinning anew asks the driver for page-locked memory, which can wait for the
    device (a step's upload once took 0.6 s behind the copies to the host under generation).
    """
    t = torch.from_numpy(np.ascontiguousarray(host)) if isinstance(host, np.ndarray) else host
    if device.type != "cuda":
        return t.to(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STAGING:
        _STAGING[index] = _Staging(_STAGING_BYTES)
    return _STAGING[index].upload(t.contiguous(), torch.device("cuda", index))


_STAGING_BYTES = 32 << 20   # a step's inputs are a few MB at most
_STAGING: dict[int, "_Staging"] = {}


class _Staging:
    """A ring of pinned bytes: each upload takes the next free span, copies into it and
    queues the copy to the device; a span is reused once the event after its copy has
    passed (in practice long before). Uploads larger than the ring are pinned on their own."""

    _ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.head = 0
        self.busy: collections.deque[tuple[int, torch.cuda.Event]] = collections.deque()

    def _reserve(self, n: int) -> int:
        """Offset of `n` free bytes, waiting for the oldest spans' copies as needed."""
        cap = len(self.buf)
        while self.busy:
            tail = self.busy[0][0]
            if self.head > tail:                 # in use: [tail, head)
                if cap - self.head >= n:
                    return self.head
                if tail >= n:
                    return 0
            elif tail - self.head >= n:          # in use: [tail, cap) and [0, head)
                return self.head
            self.busy.popleft()[1].synchronize()
        return 0

    def upload(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        size = -(-max(nbytes, 1) // self._ALIGN) * self._ALIGN
        if size > len(self.buf):
            return t.pin_memory().to(device, non_blocking=True)
        at = self._reserve(size)
        staged = self.buf[at:at + nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        out.copy_(staged, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self.busy.append((at, done))
        self.head = at + size
        return out
