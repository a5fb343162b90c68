"""dist.ComputeGap: the compute stream's idle time across a stretch of host work (the worker's
`switch/queue_s`). On CPU it is the host's time; on CUDA only the part no queued work
covers."""

import time
import types

import pytest
import torch

from handoff.dist import ComputeGap, wait_for_compute


def test_on_cpu_the_gap_is_the_hosts_time(monkeypatch):
    import handoff.dist as dist_module

    clock = iter([10.0, 10.25])   # the host's clock at the stretch's start and its close
    monkeypatch.setattr(dist_module, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    gap = ComputeGap(torch.device("cpu"))
    gap.close()
    assert gap.seconds() == 0.25


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("queued_s", [0.0, 0.3])
def test_on_cuda_queued_work_covers_the_hosts_time(queued_s):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda._sleep(1000)   # the kernel loaded before anything is timed
    wait_for_compute(device)
    rate = _sleep_cycles_per_second(device)
    if queued_s:
        torch.cuda._sleep(int(queued_s * rate))   # the device busy past the host's work
    gap = ComputeGap(device)
    time.sleep(0.1)
    gap.close()
    wait_for_compute(device)
    if queued_s:
        assert gap.seconds() < 0.02
    else:
        assert 0.09 <= gap.seconds() < 0.3


def _sleep_cycles_per_second(device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    wait_for_compute(device)
    return 10_000_000 / (start.elapsed_time(end) / 1e3)
