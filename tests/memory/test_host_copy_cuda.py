"""The SM-driven copies between host and device (run on the device; skipped without a GPU)."""

import pytest
import torch

from handoff.memory.host_copy import copy_from_host, results_to_host

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _registered(nbytes: int) -> torch.Tensor:
    """Plain host memory page-locked with cudaHostRegister, as the arena pins it."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)) == 0
    return buf


@pytest.mark.parametrize("programs", [None, 3])
@pytest.mark.parametrize("pinning", ["pin_memory", "registered"])
@pytest.mark.parametrize("nbytes", [1, 4099, 16 << 20, (16 << 20) + 3])
def test_copy_from_host_lands_every_byte(pinning, nbytes, programs):
    src = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pinning == "pin_memory"
           else _registered(nbytes))
    src.random_(0, 256)
    dst = torch.zeros(nbytes + 64, dtype=torch.uint8, device="cuda")
    copy_from_host(dst[16:16 + nbytes], src, programs=programs)
    torch.cuda.synchronize()
    assert torch.equal(dst[16:16 + nbytes].cpu(), src)
    assert not dst[:16].any() and not dst[16 + nbytes:].any()   # nothing written outside
    if pinning == "registered":
        torch.cuda.cudart().cudaHostUnregister(src.data_ptr())


def test_copy_from_host_from_an_unaligned_source_falls_back_to_the_copy_engine():
    src = torch.empty(4096 + 1, dtype=torch.uint8, pin_memory=True).random_(0, 256)
    dst = torch.empty(4096, dtype=torch.uint8, device="cuda")
    copy_from_host(dst, src[1:])
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src[1:])


@pytest.mark.parametrize("n", [1, 255, 1025])
def test_results_to_host_writes_the_pinned_rows_and_nothing_past_them(n):
    tokens_B = torch.randint(0, 1 << 40, (n,), device="cuda")
    logprobs_B = -torch.rand(n, device="cuda")
    tokens = torch.full((n + 8,), -7, dtype=torch.int64, pin_memory=True)
    logprobs = torch.full((n + 8,), 3.0, dtype=torch.float32, pin_memory=True)
    results_to_host(tokens[:n], logprobs[:n], tokens_B, logprobs_B)
    torch.cuda.synchronize()
    assert torch.equal(tokens[:n], tokens_B.cpu()) and torch.equal(logprobs[:n], logprobs_B.cpu())
    assert (tokens[n:] == -7).all() and (logprobs[n:] == 3.0).all()


def test_results_to_host_does_not_wait_behind_a_large_copy_to_the_host():
    """The copy engine's D2H queue is busy with a 4 GB copy; the kernel's results land first."""
    big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    host = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    tokens_B = torch.arange(64, device="cuda")
    logprobs_B = torch.zeros(64, device="cuda")
    tokens = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    logprobs = torch.ones(64, dtype=torch.float32, pin_memory=True)
    results_to_host(tokens, logprobs, tokens_B, logprobs_B)   # compiled before it is timed
    torch.cuda.synchronize()
    tokens.zero_()
    logprobs.fill_(1.0)
    with torch.cuda.stream(side):
        host.copy_(big, non_blocking=True)
    big_done = torch.cuda.Event()
    big_done.record(side)
    results_to_host(tokens, logprobs, tokens_B, logprobs_B)
    ready = torch.cuda.Event()
    ready.record()
    ready.synchronize()
    assert not big_done.query(), "the 4 GB copy ended first: the test shows nothing"
    assert torch.equal(tokens, tokens_B.cpu()) and not logprobs.any()
    big_done.synchronize()


def test_uploads_through_the_pinned_ring_land_intact_while_it_wraps():
    import numpy as np

    from handoff.memory import host_copy

    rng = np.random.default_rng(0)
    sent, got = [], []
    for i in range(400):   # ~3x the ring's 32 MB: it wraps, reusing spans
        n = int(rng.integers(1, 64_000))
        array = rng.integers(-2**40, 2**40, n) if i % 3 else rng.random(n).astype(np.float32)
        sent.append(array)
        got.append(host_copy.upload(array, torch.device("cuda")))
    big = np.arange((40 << 20) // 8)   # larger than the ring: pinned on its own
    assert torch.equal(host_copy.upload(big, torch.device("cuda")).cpu(), torch.from_numpy(big))
    for array, dev in zip(sent, got):
        assert torch.equal(dev.cpu(), torch.from_numpy(array))
