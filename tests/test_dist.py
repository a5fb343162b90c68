"""`end_distributed_run`: a torchrun rank leaves cleanly even while a gloo thread runs Python.

The job below registers a completion callback on a collective of a group that outlives
`destroy_process_group` (as FSDP2's does in `handoff train`). The callback runs on gloo's
worker thread and keeps running Python until the interpreter finalizes: the same situation
as a gloo thread dropping a finished work's tensors at exit, made certain instead of rare.
With barrier + destroy + a normal interpreter exit (the teardown before `os._exit` was
added), this test failed in 3 of 3 runs ("terminate called without an active exception");
`end_distributed_run` must exit 0.
Alone (no torchrun) it only tears the group down and returns.
"""

import os
import socket
import subprocess
import sys

import pytest

JOB = """
import sys, threading, time
import torch, torch.distributed as dist
from handoff.dist import end_distributed_run

if len(sys.argv) > 1:   # alone: a 1-process group, as `handoff train` makes without torchrun
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
kept = dist.new_group(list(range(dist.get_world_size())))   # referenced past the destroy

def python_on_a_gloo_thread(_):
    if threading.current_thread() is threading.main_thread():
        return   # the collective was done before the callback was added: it runs here, now
    deadline = time.monotonic() + 20
    while not sys.is_finalizing() and time.monotonic() < deadline:
        time.sleep(0.001)

work = dist.all_reduce(torch.ones(8), group=kept, async_op=True)
if dist.get_world_size() > 1:
    work.get_future().then(python_on_a_gloo_thread)
print(f"rank {rank} wrote its outputs", flush=True)
end_distributed_run()
print(f"rank {rank} returned, group initialized: {dist.is_initialized()}", flush=True)
"""


def run_job(tmp_path, *launcher: str, alone: bool = False) -> subprocess.CompletedProcess:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    return subprocess.run([sys.executable, *launcher, str(job), *(["alone"] if alone else [])],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_torchrun_ranks_exit_zero_while_a_gloo_thread_runs_python(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_job(tmp_path, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(port))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "terminate called" not in out
    for rank in (0, 1):
        assert f"rank {rank} wrote its outputs" in out
        assert f"rank {rank} returned" not in out   # left at once, outputs already written


def test_a_lone_process_tears_its_group_down_and_returns(tmp_path):
    done = run_job(tmp_path, alone=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "rank 0 returned, group initialized: False" in done.stdout
