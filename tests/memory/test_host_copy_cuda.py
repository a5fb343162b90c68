"""The SM-driven host-to-device copy (run on the device; skipped without a GPU)."""

import pytest
import torch

from handoff.memory.host_copy import copy_from_host

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _registered(nbytes: int) -> torch.Tensor:
    """Plain host memory page-locked with cudaHostRegister, as the arena pins it."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)) == 0
    return buf


@pytest.mark.parametrize("pinning", ["pin_memory", "registered"])
@pytest.mark.parametrize("nbytes", [1, 4099, 16 << 20, (16 << 20) + 3])
def test_copy_from_host_lands_every_byte(pinning, nbytes):
    src = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pinning == "pin_memory"
           else _registered(nbytes))
    src.random_(0, 256)
    dst = torch.zeros(nbytes + 64, dtype=torch.uint8, device="cuda")
    copy_from_host(dst[16:16 + nbytes], src)
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
