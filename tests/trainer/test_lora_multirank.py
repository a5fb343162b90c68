"""LoRA under two gloo processes (lora_replica_job.py) against the same updates in one.

With share_base each rank's adapters are a replica over its own engine's weights: after two
updates on different rows both ranks hold the same adapters bit for bit (their grads were
all-reduced), equal to one process training on all the rows, and no engine weight changed.
With share_base=false the base is FSDP-sharded and the adapters gathered for the sync: the
same adapters again, in every rank's engine.
"""

from pathlib import Path

import pytest
import torch

from handoff.modelzoo import init_model
from rank_jobs import run_ranks

HERE = Path(__file__).parent


def _launch(ckpt, out, share: bool, world: int) -> list[dict]:
    run_ranks(HERE / "lora_replica_job.py", [str(ckpt), str(out), "1" if share else "0"],
              world=world)
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
