"""actor.compile: decoder layers through torch.compile give the eager path's numbers, and new
micro-batch lengths do not compile again.

The graphs are built with dynamo's aot_eager backend (the same capture, autograd and graph
breaks as inductor without its code generation, which takes minutes on a small CI host); the
device run uses inductor (docs/PERF.md).
"""

import pytest
import torch

from handoff.config import ActorConfig
from handoff.modelzoo import init_model
from handoff.trainer import compiled
from handoff.trainer.actor import Actor
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.grpo import group_advantages
from handoff.trainer.model import ShardedModel

from test_packing import long_tailed_batch


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A compile's persistent cache in this test's directory; torch's variable restored."""
    from handoff import compile_cache

    monkeypatch.setenv("HANDOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compile_cache, "_active", False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("tq"), dtype="float32", seed=1))


def _actor(ckpt, **kw):
    torch.manual_seed(0)
    cfg = ActorConfig(micro_batch_tokens=kw.pop("micro_batch_tokens", 48), logprob_chunk_tokens=16,
                      gradient_checkpointing=kw.pop("gradient_checkpointing", False), **kw)
    return Actor(ckpt, actor=cfg, device="cpu", dtype="float32")


def _step_numbers(actor):
    batch = long_tailed_batch()
    batch.advantages = group_advantages(batch.rewards, batch.group_size)
    logp, _ = actor.log_probs(batch, with_entropy=False)
    sums = actor.accumulate(batch)
    grads = [p.grad.full_tensor().clone() for p in actor.module.parameters()]
    return logp, sums, grads


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_match_eager(ckpt, monkeypatch, checkpointing):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    eager = _step_numbers(_actor(ckpt, gradient_checkpointing=checkpointing))
    actor = _actor(ckpt, gradient_checkpointing=checkpointing, compile=True)
    assert compiled.layers_compiled(actor.module)
    got = _step_numbers(actor)
    assert torch.allclose(got[0], eager[0], atol=1e-5)
    assert torch.allclose(got[1], eager[1], atol=1e-5)
    for g, e in zip(got[2], eager[2]):
        assert torch.allclose(g, e, atol=1e-5)


def test_compile_switches_off_and_on_again(ckpt, monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    ref = ShardedModel(ckpt, role="ref", device="cpu", dtype="float32", micro_batch_tokens=48,
                       compile_layers=True)
    layer = ref.module.model.layers[0]
    assert compiled.layers_compiled(ref.module) and "forward" in layer.__dict__
    batch = long_tailed_batch()
    on, _ = ref.log_probs(batch, with_entropy=False)
    compiled.set_compiled_layers(ref.module, False)
    assert not compiled.layers_compiled(ref.module) and "forward" not in layer.__dict__
    off, _ = ref.log_probs(batch, with_entropy=False)
    assert torch.allclose(on, off, atol=1e-5)
    compiled.set_compiled_layers(ref.module, True)
    compiled.set_compiled_layers(ref.module, True)        # idempotent: compiled once
    assert not hasattr(layer.__dict__["_handoff_eager_forward"], "_torchdynamo_orig_callable")


def _batch(response_len, rows=4):
    g = torch.Generator().manual_seed(response_len)
    prompts = [[256, 7, 8]] * rows
    responses = [torch.randint(0, 256, (response_len,), generator=g).tolist()] * rows
    return RolloutBatch.from_tokens(prompts, responses, [0.0, 1.0] * (rows // 2), group_size=2,
                                    pad_id=259)


@pytest.mark.slow
def test_new_lengths_do_not_compile_again(ckpt, monkeypatch):
    # Dynamo's capture is what decides recompiles; its plain backend skips code generation.
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    torch._dynamo.reset()   # earlier tests' graphs of the same layer code
    actor = _actor(ckpt, compile=True)   # packed micro-batches: their token count varies
    counts = []
    for length in (5, 11, 17):
        batch = _batch(length)
        batch.advantages = group_advantages(batch.rewards, batch.group_size)
        before = compiled.compiles_so_far()
        actor.log_probs(batch, with_entropy=False)   # without grad, then with it
        actor.accumulate(batch)
        counts.append(compiled.compiles_so_far() - before)
    assert counts[0] > 0 and counts[1:] == [0, 0], counts


def test_compiled_lora_layers_match_eager_with_adapters_on_and_off(ckpt, monkeypatch):
    """peft's LoRA layers inside the compiled decoder layers (actor.compile with actor.lora):
    the reference's log-probs (the adapters switched off: a flag the compiled code must guard
    on), then the policy's loss sums and the adapters' grads (adapters on) are the eager
    path's."""
    from handoff.config import LoraConfig

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")

    def numbers(compile_layers):
        actor = _actor(ckpt, compile=compile_layers, lora=LoraConfig(rank=4, alpha=8))
        for name, p in actor.module.named_parameters():   # B live, so adapters change outputs
            if "lora_B" in name:
                local = p.to_local() if hasattr(p, "to_local") else p   # FSDP's shard (all of it)
                with torch.no_grad():
                    local.copy_(torch.randn(local.shape,
                                            generator=torch.Generator().manual_seed(7)))
        batch = long_tailed_batch()
        batch.advantages = group_advantages(batch.rewards, batch.group_size)
        batch.ref_logprobs = actor.base_log_probs(batch)
        sums = actor.accumulate(batch)
        grads = {n: p.grad.full_tensor().clone() for n, p in actor.module.named_parameters()
                 if p.grad is not None}
        return batch.ref_logprobs, sums, grads

    (base, sums, grads), (got_base, got_sums, got_grads) = numbers(False), numbers(True)
    assert torch.allclose(got_base, base, atol=1e-5)
    assert torch.allclose(got_sums, sums, atol=1e-5)
    assert sorted(got_grads) == sorted(grads) and grads and all("lora_" in n for n in grads)
    for name, grad in grads.items():
        assert grad.abs().max() > 0
        assert torch.allclose(got_grads[name], grad, atol=1e-6), name
