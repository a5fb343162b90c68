"""The FSDP2 actor in one process (world size 1): bytes, log-probs, offload, full params."""

import pytest
import torch
from safetensors.torch import load_file

from handoff.config import ActorConfig, load_config
from handoff.errors import HandoffError
from handoff.modelzoo import init_model
from handoff.plan.shapes import PRESETS, count_params
from handoff.train.actor import Actor, build_reference
from handoff.train.batch import RolloutBatch
from handoff.train.grpo import group_advantages
from handoff.runplan import RunPlan

N_TINY = count_params(PRESETS["tiny-qwen3"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("tq32"), dtype="float32"))


@pytest.fixture(scope="module")
def ckpt_bf16(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("tq16"), dtype="bfloat16"))


def make_batch(seed=0, groups=2, n=4):
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [256] + torch.randint(0, 256, (int(torch.randint(1, 5, (1,), generator=g)),),
                                       generator=g).tolist()
        for _ in range(n):
            prompts.append(prompt)
            length = int(torch.randint(1, 7, (1,), generator=g))
            responses.append(torch.randint(0, 256, (length,), generator=g).tolist())
    rewards = torch.randint(0, 2, (groups * n,), generator=g).float().tolist()
    return RolloutBatch.from_tokens(prompts, responses, rewards, group_size=n, pad_id=259)


def storage_bytes(tensors):
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("dtype, opt_bytes", [("float32", 8), ("bfloat16", 12)])
def test_memory_parts_are_the_bytes_actually_held(ckpt, ckpt_bf16, dtype, opt_bytes):
    actor = Actor(ckpt if dtype == "float32" else ckpt_bf16, actor=ActorConfig(), dtype=dtype)
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    parts = actor.memory_parts()
    assert parts == {"params": N_TINY * size, "grads": N_TINY * size,
                     "optimizer": N_TINY * opt_bytes}
    assert storage_bytes(actor.part_tensors("params")) == parts["params"]
    assert storage_bytes(actor.optimizer.tensors().values()) == parts["optimizer"]
    batch = make_batch()
    batch.advantages = group_advantages(batch.rewards, batch.group_size)
    actor.accumulate(batch)
    assert storage_bytes(actor.part_tensors("grads")) == parts["grads"]
    actor.step()
    assert all(p.grad is None for p in actor.module.parameters())


def test_log_probs_match_a_plain_hf_forward_for_any_micro_batch(ckpt):
    from transformers import AutoModelForCausalLM

    batch = make_batch(seed=1)
    plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        logits = plain(input_ids=batch.input_ids).logits[:, :-1].double()
    logp_ref = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    probs = torch.softmax(logits, -1)
    ent_ref = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    valid = batch.attention_mask[:, 1:].bool()
    for mbs in (1, 3, 8):
        actor = Actor(ckpt, actor=ActorConfig(micro_batch_size=mbs), dtype="float32")
        logp, ent = actor.log_probs(batch)
        assert (logp[:, 0] == 0).all()
        assert torch.allclose(logp[:, 1:][valid].double(), logp_ref[valid], atol=1e-5)
        assert torch.allclose(ent[:, 1:][valid].double(), ent_ref[valid], atol=1e-5)


def test_offload_onload_round_trip_is_bit_exact_and_frees_storage(ckpt_bf16):
    actor = Actor(ckpt_bf16, actor=ActorConfig(lr=1e-2), dtype="bfloat16")
    batch = make_batch(seed=2)
    actor.update(batch)                                   # optimizer moments are non-zero now
    before = {"params": [t.clone() for t in actor.part_tensors("params")],
              "optimizer": [t.clone() for t in actor.optimizer.tensors().values()]}
    moved = actor.to("host", params=True, optimizer=True).wait()
    parts = actor.memory_parts()
    assert {k: v["bytes"] for k, v in moved.items()} == {"params": parts["params"],
                                                         "optimizer": parts["optimizer"]}
    assert storage_bytes(actor.part_tensors("params")) == 0
    assert storage_bytes(actor.optimizer.tensors().values()) == 0
    assert actor.to("host", params=True).wait()["params"]["bytes"] == 0   # already there
    with pytest.raises(HandoffError, match="offloaded"):
        actor.update(batch)
    back = actor.to("device", optimizer=True).wait()
    assert back["optimizer"]["bytes"] == parts["optimizer"]
    with pytest.raises(HandoffError, match="params are offloaded"):
        actor.log_probs(batch)
    actor.to("device", params=True).wait()
    for t, ref in zip(actor.part_tensors("params"), before["params"]):
        assert torch.equal(t, ref)
    for t, ref in zip(actor.optimizer.tensors().values(), before["optimizer"]):
        assert torch.equal(t, ref)
    # grads move only when asked, and only while they exist
    batch.advantages = group_advantages(batch.rewards, batch.group_size)
    actor.accumulate(batch)
    grads = [g.clone() for g in actor.part_tensors("grads")]
    assert actor.to("host", grads=True).wait()["grads"]["bytes"] == parts["grads"]
    assert storage_bytes(actor.part_tensors("grads")) == 0
    actor.to("device", grads=True).wait()
    assert all(torch.equal(g, r) for g, r in zip(actor.part_tensors("grads"), grads))
    with pytest.raises(HandoffError, match="cannot move"):
        actor.to("cuda", params=True)


def test_gradient_checkpointing_gives_the_same_loss_and_grads(ckpt, monkeypatch):
    batch = make_batch(seed=3)
    batch.advantages = group_advantages(batch.rewards, batch.group_size)
    results = []
    for gc in (False, True):
        actor = Actor(ckpt, actor=ActorConfig(gradient_checkpointing=gc, micro_batch_size=3,
                                              entropy_coef=0.01), dtype="float32")
        calls = []
        mlp_cls = type(actor.module.model.layers[0].mlp)
        monkeypatch.undo()
        monkeypatch.setattr(mlp_cls, "forward", lambda *a, _f=mlp_cls.forward, **k:
                            calls.append(1) or _f(*a, **k))
        sums = actor.accumulate(batch)
        # 2 layers x 3 micro-batches, each run again in backward when checkpointing is on
        assert len(calls) == 6 * (2 if gc else 1)
        results.append((sums, [g.clone() for g in actor.part_tensors("grads")]))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-6)


def test_full_params_are_the_checkpoint_tensors(ckpt):
    actor = Actor(ckpt, actor=ActorConfig(), dtype="float32")
    saved = load_file(f"{ckpt}/model.safetensors")
    got = dict(actor.full_params())
    assert set(got) == set(saved) - {"lm_head.weight"}      # tied: the embedding carries it
    for name, t in got.items():
        assert torch.equal(t, saved[name]), name
    name, t = next(actor.full_params(dtype="bfloat16"))
    assert t.dtype == torch.bfloat16 and torch.equal(t, saved[name].bfloat16())


def test_kl_needs_ref_logprobs_and_the_reference_only_exists_with_kl(ckpt):
    cfg = load_config(None, [f"model.path={ckpt}", "model.dtype=float32"])
    assert build_reference(cfg, RunPlan.build(cfg), device="cpu") is None
    cfg.actor.kl_coef = 0.1
    ref = build_reference(cfg, RunPlan.build(cfg), device="cpu")
    assert ref.memory_parts() == {"params": N_TINY * 4}
    with pytest.raises(HandoffError, match="no part 'optimizer'"):
        ref.to("host", optimizer=True)
    assert ref.to("host", params=True).wait()["params"]["bytes"] == N_TINY * 4
    assert storage_bytes(ref.part_tensors("params")) == 0
    actor = Actor(ckpt, actor=cfg.actor, dtype="float32")
    with pytest.raises(HandoffError, match="ref_logprobs"):
        actor.update(make_batch())


def test_fsdp_offload_mode_trains_identically_and_moves_nothing(ckpt):
    batch = make_batch(seed=4)
    metrics = []
    for mode in ("arena", "fsdp"):
        actor = Actor(ckpt, actor=ActorConfig(lr=1e-2), dtype="float32", offload_mode=mode)
        metrics.append([actor.update(batch) for _ in range(2)])
    assert metrics[0] == metrics[1]
    assert metrics[0][1]["entropy"] != metrics[0][0]["entropy"]  # the first step moved the policy
    assert all(t.device.type == "cpu" for t in actor.part_tensors("optimizer"))
    assert actor.to("host", params=True, optimizer=True).wait()["params"]["bytes"] == 0


def test_a_frozen_reference_is_dropped_without_a_copy_the_actor_is_not(ckpt):
    cfg = load_config(None, [f"model.path={ckpt}", "model.dtype=float32", "actor.kl_coef=0.1"])
    ref = build_reference(cfg, RunPlan.build(cfg), device="cpu")
    batch = make_batch(seed=3)
    want, _ = ref.log_probs(batch, with_entropy=False)
    assert ref.to("host", params=True).wait()["params"]["bytes"] > 0   # the one real copy
    for _ in range(2):
        ref.to("device", params=True).wait()
        got, _ = ref.log_probs(batch, with_entropy=False)
        assert torch.equal(got, want)
        assert ref.to("host", params=True, copy=False).wait()["params"]["bytes"] == 0
        assert storage_bytes(ref.part_tensors("params")) == 0        # freed all the same
    actor = Actor(ckpt, actor=ActorConfig(), dtype="float32")
    actor.to("host", params=True).wait()
    actor.to("device", params=True).wait()
    with pytest.raises(HandoffError, match="change as it trains"):
        actor.to("host", params=True, copy=False)
