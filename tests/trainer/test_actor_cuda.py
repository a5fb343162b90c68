"""The actor on a GPU: async arena offload frees and restores HBM exactly; FSDP offload mode."""

import pytest
import torch
from safetensors.torch import load_file

from handoff.config import ActorConfig
from handoff.modelzoo import init_model
from handoff.plan.shapes import PRESETS, count_params
from handoff.trainer.actor import Actor
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

N = count_params(PRESETS["tiny-qwen3"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("m"), dtype="bfloat16"))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [[256, 1, 2, 3]] * 4 + [[256, 9]] * 4
    responses = [torch.randint(0, 256, (int(torch.randint(2, 30, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(8)]
    return RolloutBatch.from_tokens(prompts, responses, [1, 0, 0, 1, 1, 1, 0, 0],
                                    group_size=4, pad_id=259).to("cuda")


def test_offload_frees_hbm_and_onload_restores_it_bit_exactly(ckpt):
    actor = Actor(ckpt, actor=ActorConfig(lr=1e-3, micro_batch_size=4), device="cuda")
    assert actor.memory_parts() == {"params": 2 * N, "grads": 2 * N, "optimizer": 12 * N}
    actor.update(batch())
    tensors = actor.part_tensors("params") + actor.part_tensors("optimizer")
    saved = [t.clone() for t in tensors]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved = actor.to("host", params=True, optimizer=True).wait()
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    total = moved["params"]["bytes"] + moved["optimizer"]["bytes"]
    assert total == 14 * N
    assert total <= freed <= total + 512 * len(tensors)      # blocks round up to 512 B
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    back = actor.to("cuda", params=True, optimizer=True).wait()
    assert back["optimizer"]["bytes"] == 12 * N and back["optimizer"]["seconds"] > 0
    assert torch.cuda.memory_allocated() == before
    assert all(torch.equal(a, b) for a, b in zip(tensors, saved))


def test_compute_right_after_an_unawaited_onload_sees_the_data(ckpt):
    results = []
    for offload in (False, True):
        actor = Actor(ckpt, actor=ActorConfig(lr=1e-3, micro_batch_size=4), device="cuda")
        actor.update(batch())
        if offload:
            actor.to("host", params=True, optimizer=True).wait()
            # No wait: the compute that needs each part waits for its copy (the optimizer's
            # at the optimizer step, after the forwards and backwards).
            actor.to("device", params=True, optimizer=True)
        results.append(actor.update(batch(1)))
    for k, v in results[0].items():
        assert results[1][k] == pytest.approx(v, rel=1e-3, abs=1e-5), k


def test_full_params_on_cuda_are_the_checkpoint(ckpt):
    actor = Actor(ckpt, actor=ActorConfig(), device="cuda")
    saved = load_file(f"{ckpt}/model.safetensors")
    for name, t in actor.full_params():
        assert t.is_cuda and torch.equal(t.cpu(), saved[name])


def test_fsdp_offload_mode_keeps_state_on_host(ckpt):
    actor = Actor(ckpt, actor=ActorConfig(micro_batch_size=4), device="cuda", offload_mode="fsdp")
    assert all(t.device.type == "cpu" for t in actor.part_tensors("params"))
    assert all(t.device.type == "cpu" for t in actor.optimizer.tensors().values())
    metrics = actor.update(batch())
    assert metrics["num_tokens"] > 0
    assert actor.to("host", params=True, optimizer=True).wait()["params"]["bytes"] == 0


def test_checkpoint_round_trip_on_cuda(ckpt, tmp_path):
    actor = Actor(ckpt, actor=ActorConfig(lr=1e-3, micro_batch_size=4), device="cuda")
    actor.update(batch())
    save_checkpoint(tmp_path, actor, step=1)
    m2 = actor.update(batch(1))
    load_checkpoint(tmp_path, actor)
    m2b = actor.update(batch(1))
    for k in m2:
        assert m2b[k] == pytest.approx(m2[k], rel=1e-3, abs=1e-5), k
