"""The LoRA actor (trainer/lora.py) on CPU: the same log-probs, loss and adapter grads as
transformers + peft's `get_peft_model` (tiny Qwen3 and Llama); the base shared with the
engine's weights, never written; the reference is the actor with its adapters off; the
parts count the adapters only; a checkpoint holds the adapters only."""

import hashlib

import pytest
import torch

from handoff.config import ActorConfig, LoraConfig
from handoff.errors import HandoffError
from handoff.modelzoo import init_model
from handoff.rollout.engine import Engine
from handoff.rollout.sampling import SamplingParams
from handoff.switch.lora import sync_lora
from handoff.trainer import grpo
from handoff.trainer.actor import Actor
from handoff.trainer.checkpoint import load_checkpoint, save_checkpoint
from handoff.trainer.optim import local_shard
from test_actor import make_batch

RANK, ALPHA = 4, 8
LORA = LoraConfig(rank=RANK, alpha=ALPHA)


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def model_dir(request, tmp_path_factory):
    return str(init_model(request.param, tmp_path_factory.mktemp(request.param),
                          dtype="float32"))


def _batch(seed=0, groups=2, n=4):
    """test_actor's batch with rewards that vary inside every group (adapters' grads nonzero)."""
    batch = make_batch(seed, groups, n)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(groups * n)])
    batch.advantages = grpo.group_advantages(batch.rewards, batch.group_size)
    return batch


def _engine(model_dir):
    from handoff.config import RolloutConfig

    cfg = RolloutConfig(num_blocks=64, block_size=8, max_model_len=128, cuda_graphs=False)
    return Engine(model_dir, cfg, device="cpu", dtype="float32", lora_max_rank=RANK)


def _actor(model_dir, engine=None, **actor_kw):
    cfg = ActorConfig(lora=LORA, micro_batch_size=3, **actor_kw)
    return Actor(model_dir, actor=cfg, dtype="float32",
                 engine_base=engine.export_weight if engine is not None else None)


def _peft(model_dir):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                               target_modules=list(LORA.target_modules)))


def _lively_adapters(actor, peft_model, seed=5):
    """B drawn non-zero (peft starts it at zero), the same values in both models."""
    gen = torch.Generator().manual_seed(seed)
    theirs = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, p in actor.module.named_parameters():
            if p.requires_grad:
                value = torch.randn(p.shape, generator=gen) * 0.5 / p.shape[1] ** 0.5
                local_shard(p).copy_(value)   # world size 1: the shard is the whole tensor
                theirs[f"base_model.model.{name}"].copy_(value)


def _peft_logp(model, batch):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
        -1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(len(batch), 1), logp], dim=1)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-base", "own-base"])
def test_log_probs_loss_and_adapter_grads_equal_peft(model_dir, shared):
    engine = _engine(model_dir) if shared else None
    actor = _actor(model_dir, engine, kl_coef=0.1)
    peft_model = _peft(model_dir)
    _lively_adapters(actor, peft_model)
    batch = _batch()
    mask = batch.response_mask.bool()

    with torch.no_grad():
        ref_theirs = _peft_logp(peft_model.eval(), batch)
        with peft_model.disable_adapter():
            base_theirs = _peft_logp(peft_model, batch)
    assert not torch.allclose(ref_theirs[mask], base_theirs[mask], atol=1e-3)  # B is live
    assert torch.allclose(actor.log_probs(batch)[0][mask], ref_theirs[mask], atol=1e-5)
    batch.ref_logprobs = actor.base_log_probs(batch)
    assert torch.allclose(batch.ref_logprobs[mask], base_theirs[mask], atol=1e-5)
    # The adapters are trainable again after the reference's pass.
    assert all(p.requires_grad for n, p in actor.module.named_parameters() if "lora_" in n)

    sums = actor.accumulate(batch)
    peft_model.train()
    logp = _peft_logp(peft_model, batch)
    weights = grpo.aggregation_weights(batch.response_mask.float(), "token_mean")
    s = grpo.grpo_loss_sums(logp, logp.detach(), batch.advantages, batch.response_mask,
                            clip_low=0.2, clip_high=0.2, ref_logp_BT=batch.ref_logprobs,
                            kl_coef=0.1, weight_BT=weights)
    (s.objective / batch.response_mask.sum()).backward()
    assert torch.allclose(sums[:3], s.stacked()[:3], atol=1e-5)   # loss, pg_loss, kl
    theirs = dict(peft_model.named_parameters())
    grads = {n: local_shard(p.grad) for n, p in actor.module.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 7 * 2   # A and B of seven projections on both layers
    for name, grad in grads.items():
        other = theirs[f"base_model.model.{name}"].grad
        assert other.abs().max() > 0
        assert torch.allclose(grad, other, atol=1e-6), name
    assert all(p.grad is None for n, p in actor.module.named_parameters() if "lora_" not in n)


def _checksum(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_the_base_is_the_engines_weights_and_nothing_writes_it(model_dir):
    engine = _engine(model_dir)
    engine_tensors = list(engine.model.parameters())
    before = _checksum(engine_tensors)
    actor = _actor(model_dir, engine, lr=1e-2)
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                for t in engine_tensors}
    base = [(n, p) for n, p in actor.module.named_parameters() if "lora_" not in n]
    assert base
    for name, p in base:   # each a view inside one of the engine's storages
        ptr = p.data_ptr()
        assert any(lo <= ptr and ptr + p.numel() * p.element_size() <= lo + size
                   for lo, size in storages), name
    fused = engine.export_weight("model.layers.0.self_attn.k_proj.weight")
    assert actor.module.model.layers[0].self_attn.k_proj.base_layer.weight.data_ptr() == \
        fused.data_ptr()
    # The parts are the adapters: offloading "params" moves them, never the engine's weights.
    adapters = [p for n, p in actor.module.named_parameters() if "lora_" in n]
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
    assert actor.memory_parts() == {"params": adapter_bytes, "grads": adapter_bytes,
                                    "optimizer": 2 * adapter_bytes}
    actor.to("host", params=True, optimizer=True).wait()
    assert _checksum(engine_tensors) == before
    actor.to("device", params=True, optimizer=True).wait()

    o_proj = actor.module.model.layers[1].self_attn.o_proj
    slot = engine.lora.linears["model.layers.1.self_attn.o_proj"].lora
    for step in range(3):
        metrics = actor.update(_batch(seed=step))
        assert metrics["grad_norm"] > 0
        engine.sleep_kv()
        engine.wake_up(["kv_cache"])
        stats = sync_lora(actor, engine)
        assert stats.bytes == adapter_bytes
        # The sync copied the adapters in place (the engine folds alpha / r into A).
        assert torch.equal(slot.B[:, :RANK], o_proj.lora_B.default.weight)
        assert torch.allclose(slot.A[:RANK], o_proj.lora_A.default.weight * ALPHA / RANK)
        assert engine.generate([[256, 5, 6]], SamplingParams(temperature=0.0, max_tokens=4))
    assert o_proj.lora_B.default.weight.abs().max() > 0   # trained away from zero
    assert _checksum(engine_tensors) == before
    now = [p for n, p in actor.module.named_parameters() if "lora_" not in n]
    assert [p.data_ptr() for _, p in base] == [p.data_ptr() for p in now]


def test_a_shared_base_of_another_dtype_is_refused(model_dir):
    engine = _engine(model_dir)
    with pytest.raises(HandoffError, match="share_base=false"):
        Actor(model_dir, actor=ActorConfig(lora=LORA), dtype="bfloat16",
              engine_base=engine.export_weight)


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_identically(model_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    def trained(steps, resume_from=None):
        torch.manual_seed(0)
        actor = _actor(model_dir, _engine(model_dir), lr=1e-2)
        if resume_from is not None:
            assert load_checkpoint(resume_from, actor)["step"] == 2
        for step in range(steps):
            actor.update(_batch(seed=10 + step + (2 if resume_from else 0)))
        return actor

    saved = trained(2)
    save_checkpoint(tmp_path / "ck", saved, step=2)
    path = next((tmp_path / "ck").glob("step_*"))
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == {n for n, p in saved.module.named_parameters() if "lora_" in n}
    assert all(".lora_A.default.weight" in k or ".lora_B.default.weight" in k for k in model_keys)
    import json
    assert json.loads((path / "meta.json").read_text())["lora"] == {
        "rank": RANK, "alpha": ALPHA, "target_modules": list(LORA.target_modules)}

    straight = trained(2)
    for step in range(2):
        straight.update(_batch(seed=12 + step))
    resumed = trained(2, resume_from=tmp_path / "ck")
    for (n, a), (_, b) in zip(straight.module.named_parameters(),
                              resumed.module.named_parameters()):
        assert torch.equal(a, b), n
    assert resumed.optimizer.step_count == 4

    # written before the config kept target_modules in one order: the same adapter resumes
    meta = json.loads((path / "meta.json").read_text())
    meta["lora"]["target_modules"] = meta["lora"]["target_modules"][::-1] + ["q_proj"]
    (path / "meta.json").write_text(json.dumps(meta))
    trained(0, resume_from=tmp_path / "ck")

    full = Actor(model_dir, actor=ActorConfig(), dtype="float32")
    with pytest.raises(HandoffError, match="LoRA adapter .rank 4.*this run trains full"):
        load_checkpoint(tmp_path / "ck", full)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-base", "own-base"])
def test_the_synced_adapters_are_the_trained_ones(model_dir, shared):
    """The actor lists its adapters once (after sharding replaced the parameters): what a
    sync reads after an update is the updated adapters, every one, in module order."""
    actor = _actor(model_dir, _engine(model_dir) if shared else None, lr=1e-2)
    actor.update(_batch())
    trained = [(n, local_shard(p.detach())) for n, p in actor.module.named_parameters()
               if "lora_" in n]
    synced = list(actor.adapter_tensors())
    assert [n for n, _ in synced] == [n for n, _ in trained]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(synced, trained))
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in synced if "lora_B" in n)
