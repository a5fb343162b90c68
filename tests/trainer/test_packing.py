"""Packed micro-batches and the chunked log-prob head against today's padded, full-logits path.

Tiny Qwen3 in fp32 on CPU: per-token log-probs and entropy, the GRPO loss sums and every
gradient must agree within float tolerance for any token budget and chunk size; a token must
never attend across the sequences packed beside it.
"""

import dataclasses

import pytest
import torch

from handoff.config import ActorConfig
from handoff.errors import HandoffError
from handoff.modelzoo import init_model
from handoff.trainer.actor import Actor
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.attention import backend_for
from handoff.trainer.grpo import group_advantages
from handoff.trainer.logprobs import chunked_token_logprobs
from handoff.trainer.packing import PackedMicroBatch, micro_batch_rows, pack_rows
from handoff.runplan import RunPlan

ATOL = 2e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("tq"), dtype="float32", seed=1))


def long_tailed_batch(seed=0, groups=3, n=4):
    """Rows of 3..40 tokens (one long response per group), ref and old log-probs set."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [256] + torch.randint(0, 256, (int(torch.randint(1, 6, (1,), generator=g)),),
                                       generator=g).tolist()
        for i in range(n):
            prompts.append(prompt)
            length = 34 if i == 0 else int(torch.randint(1, 9, (1,), generator=g))
            responses.append(torch.randint(0, 256, (length,), generator=g).tolist())
    rewards = torch.rand(groups * n, generator=g).round().tolist()
    batch = RolloutBatch.from_tokens(prompts, responses, rewards, group_size=n, pad_id=259)
    batch.ref_logprobs = -5.5 + 0.3 * torch.randn(batch.input_ids.shape, generator=g)
    return batch


def test_pack_rows_fills_first_fit_decreasing_and_keeps_every_row_once():
    lengths = [5, 30, 7, 12, 3, 3, 25]
    packs = pack_rows(lengths, budget=32)
    assert sorted(r for p in packs for r in p) == list(range(7))
    assert all(sum(lengths[r] for r in p) <= 32 for p in packs)
    assert packs == [[0, 3, 4, 5], [1], [2, 6]]     # 30 | 25 + 7 | 12 + 5 + 3 + 3
    assert pack_rows([50, 4], budget=16) == [[0], [1]]   # a row over the budget goes alone
    assert micro_batch_rows(lengths, micro_batch_tokens=0, micro_batch_size=3) == [
        [0, 1, 2], [3, 4, 5], [6]]


def test_packed_micro_batch_restarts_positions_and_maps_tokens_back():
    batch = long_tailed_batch()
    lengths = batch.attention_mask.sum(1).tolist()
    mb = PackedMicroBatch.build(batch, [1, 2, 5], lengths, torch.device("cpu"))
    total = lengths[1] + lengths[2] + lengths[5]
    assert mb.input_ids.shape == (1, total) and mb.seqs.num_seqs == 3
    assert mb.seqs.cu_seqlens.tolist() == [0, lengths[1], lengths[1] + lengths[2], total]
    pos = mb.seqs.pos_T.tolist()
    assert pos[:lengths[1]] == list(range(lengths[1])) and pos[lengths[1]] == 0
    assert torch.equal(mb.gather(batch.input_ids)[:, 0], mb.input_ids[0])
    out = torch.zeros(batch.input_ids.shape)
    mb.scatter(out, mb.gather(batch.attention_mask.float()))
    assert torch.equal(out[[1, 2, 5]], batch.attention_mask[[1, 2, 5]].float())
    assert backend_for(torch.device("cpu"), torch.float32) == "padded_sdpa"


def test_chunked_head_equals_log_softmax_in_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(19, 8, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 19, (13,), generator=g)
    coef = torch.randn(13, generator=g, dtype=torch.float64)
    results = []
    for chunk in (None, 1, 5, 64):
        hidden.grad = weight.grad = None
        if chunk is None:
            logsm = torch.log_softmax(hidden @ weight.t(), -1)
            logp, ent = logsm.gather(-1, target[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)
        else:
            logp, ent = chunked_token_logprobs(hidden, weight, target, chunk_tokens=chunk)
        (coef * logp + 0.3 * ent).sum().backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.allclose(a, b, atol=1e-12)
    small = (hidden[:5, :4].detach().requires_grad_(), weight[:7, :4].detach().requires_grad_())
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_token_logprobs(h, w, target[:5] % 7, chunk_tokens=2), small)


@pytest.mark.parametrize("tokens, chunk", [(0, 7), (48, 0), (13, 3)])
def test_log_probs_of_packed_and_chunked_paths_equal_the_padded_full_path(ckpt, tokens, chunk):
    batch = long_tailed_batch(seed=1)
    ref = Actor(ckpt, actor=ActorConfig(micro_batch_size=5), dtype="float32")
    logp0, ent0 = ref.log_probs(batch)
    actor = Actor(ckpt, actor=ActorConfig(micro_batch_size=5, micro_batch_tokens=tokens,
                                          logprob_chunk_tokens=chunk), dtype="float32")
    logp, ent = actor.log_probs(batch)
    valid = batch.attention_mask.bool()
    assert (logp[:, 0] == 0).all()
    assert torch.allclose(logp[valid], logp0[valid], atol=ATOL)
    assert torch.allclose(ent[valid], ent0[valid], atol=ATOL)


@pytest.mark.parametrize("tokens, chunk, ckpt_on", [(48, 0, False), (48, 6, True),
                                                    (0, 6, False)])
def test_loss_and_gradients_of_packed_paths_equal_the_padded_path(ckpt, tokens, chunk, ckpt_on):
    batch = long_tailed_batch(seed=2)
    batch.advantages = group_advantages(batch.rewards, batch.group_size)
    base = dict(micro_batch_size=4, kl_coef=0.05, entropy_coef=0.01)
    results = []
    for extra in ({}, dict(micro_batch_tokens=tokens, logprob_chunk_tokens=chunk,
                           gradient_checkpointing=ckpt_on)):
        actor = Actor(ckpt, actor=ActorConfig(**base, **extra), dtype="float32")
        batch.old_logprobs = actor.log_probs(batch, with_entropy=False)[0] + 0.1
        sums = actor.accumulate(batch)
        grads = {n: p.grad.full_tensor() for n, p in actor.module.named_parameters()}
        results.append((sums, grads))
    (sums0, grads0), (sums1, grads1) = results
    assert sums1[5] == sums0[5] == batch.response_mask.sum()            # same tokens
    assert torch.allclose(sums1, sums0, atol=ATOL, rtol=1e-5)
    for name, g in grads0.items():
        assert torch.allclose(grads1[name], g, atol=ATOL), name


def test_a_packed_token_never_attends_across_sequences(ckpt):
    batch = long_tailed_batch(seed=3)
    actor = Actor(ckpt, actor=ActorConfig(micro_batch_tokens=4096), dtype="float32")
    logp, _ = actor.log_probs(batch)
    assert len(micro_batch_rows(batch.attention_mask.sum(1).tolist(), micro_batch_tokens=4096,
                                micro_batch_size=1)) == 1          # every row in one pack
    changed = batch.input_ids.clone()
    changed[0, 1:int(batch.attention_mask[0].sum())] = 7               # perturb sequence 0
    perturbed = RolloutBatch(input_ids=changed, attention_mask=batch.attention_mask,
                             response_mask=batch.response_mask, rewards=batch.rewards,
                             group_size=batch.group_size)
    logp2, _ = actor.log_probs(perturbed)
    assert not torch.allclose(logp2[0], logp[0])
    assert torch.equal(logp2[1:], logp[1:])        # every other sequence: bit for bit

    # Sanity of the test itself: a plain causal pass over the packed row leaks across them.
    lengths = batch.attention_mask.sum(1).tolist()
    mb = PackedMicroBatch.build(batch, [0, 1], lengths, torch.device("cpu"))
    mb2 = PackedMicroBatch.build(perturbed, [0, 1], lengths, torch.device("cpu"))
    with torch.no_grad():
        leak = [actor.module(input_ids=m.input_ids, position_ids=m.seqs.pos_T[None]).logits
                for m in (mb, mb2)]
    second = slice(lengths[0], None)
    assert not torch.allclose(leak[0][0, second], leak[1][0, second])


def test_auto_micro_batching_resolves_to_numbers_and_explicit_values_stay():
    from handoff.config import load_config
    from handoff.trainer.actor import resolve_actor_config

    cfg = load_config(None, ["model.path=tiny-qwen3", "hardware.name=cpu",
                             "actor.micro_batch_tokens=auto", "actor.gradient_checkpointing=auto",
                             "rollout.max_model_len=256"])
    actor_cfg, choice = resolve_actor_config(RunPlan.build(cfg), "cpu")
    assert actor_cfg.micro_batch_tokens == choice.tokens >= 256
    assert actor_cfg.gradient_checkpointing is False and "recompute off" in choice.reason
    explicit = load_config(None, ["model.path=tiny-qwen3", "actor.micro_batch_tokens=512"])
    # Explicit values stay; actor.compile's auto resolves too (off on a CPU).
    assert resolve_actor_config(RunPlan.build(explicit), "cpu") == (
        dataclasses.replace(explicit.actor, compile=False), None)
    with pytest.raises(HandoffError, match="build_actor"):
        Actor("unused", actor=cfg.actor)
