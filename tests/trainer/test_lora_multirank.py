"""LoRA under two gloo processes (lora_replica_job.py) against the same updates in one.

With share_base each rank's adapters are a replica over its own engine's weights: after two
updates on different rows both ranks hold the same adapters bit for bit (their grads were
all-reduced), equal to one process training on all the rows, and no engine weight changed.
With share_base=false the base is FSDP-sharded and the adapters gathered for the sync: the
same adapters again, in every rank's engine.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from handoff.modelzoo import init_model

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"


def _launch(ckpt, out, share: bool, world: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "lora_replica_job.py"), str(ckpt), str(out),
             "1" if share else "0"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + 300
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break   # one rank failed: the other would wait in a collective forever
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    logs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return [torch.load(out / f"{world}_rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("m"), dtype="float32", seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("share", [True, False], ids=["shared-base", "sharded-base"])
def test_two_ranks_keep_one_adapter_equal_to_one_process(ckpt, tmp_path, share):
    one = _launch(ckpt, tmp_path, share, world=1)[0]
    ranks = _launch(ckpt, tmp_path, share, world=2)
    names = sorted(one["adapters"])
    assert names and all(".lora_" in n for n in names)
    for name in names:
        a, b = ranks[0]["adapters"][name], ranks[1]["adapters"][name]
        assert torch.equal(a, b), name   # the replicas never drift apart
        assert torch.allclose(a, one["adapters"][name], rtol=1e-4, atol=1e-6), name
    assert any(one["adapters"][n].abs().max() > 0 for n in names if "lora_B" in n)
    assert ranks[0]["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    for r in ranks + [one]:
        assert r["after"] == r["before"]   # the engine's weights: never written
    assert torch.equal(ranks[0]["engine_B"], ranks[1]["engine_B"])
    assert torch.allclose(ranks[0]["engine_B"], one["engine_B"], rtol=1e-4, atol=1e-6)
    assert ranks[0]["engine_B"].abs().max() > 0   # the sync reached each rank's engine
    if share:   # replicas: each rank holds (and offloads) the whole adapters
        assert ranks[0]["parts"] == one["parts"]
    else:       # FSDP shards them over the two ranks
        assert ranks[0]["parts"]["optimizer"] < one["parts"]["optimizer"]
