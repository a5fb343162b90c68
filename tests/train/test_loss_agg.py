"""actor.loss_agg and actor.scale_advantages through the actor: each aggregation's gradient
is the whole step's, however the batch is split into micro-batches (padded or packed), and
equals a plain full-batch reference written as TRL and verl write the aggregation."""

import pytest
import torch

from handoff.config import ActorConfig
from handoff.modelzoo import init_model
from handoff.train.actor import Actor
from handoff.train.grpo import LOSS_AGGREGATIONS, group_advantages, token_logprobs
from handoff.train.optim import local_shard

from test_actor import make_batch

MAX_RESPONSE_LEN = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("agg"), dtype="float32"))


def _actor_grads(ckpt, batch, loss_agg, **split):
    actor = Actor(ckpt, actor=ActorConfig(loss_agg=loss_agg, **split), dtype="float32",
                  max_response_len=MAX_RESPONSE_LEN)
    actor.accumulate(batch)
    return {n: local_shard(p.grad).clone() for n, p in zip(actor.optimizer.names,
                                                           actor.optimizer.params)}


def _reference_grads(ckpt, batch, loss_agg):
    """The whole batch in one forward; ratio 1 (old = logp detached), so l_bt = -A_b r_bt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    logp = token_logprobs(model(input_ids=batch.input_ids).logits, batch.input_ids)
    loss_BT = -batch.advantages[:, None] * torch.exp(logp - logp.detach())
    mask = batch.response_mask
    if loss_agg == "token_mean":
        loss = (loss_BT * mask).sum() / mask.sum()
    elif loss_agg == "seq_mean":
        loss = ((loss_BT * mask).sum(-1) / mask.sum(-1)).mean()
    else:
        loss = ((loss_BT * mask).sum(-1) / MAX_RESPONSE_LEN).mean()
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
def test_every_split_gives_the_whole_batchs_gradient(ckpt, loss_agg):
    batch = make_batch(seed=7)
    batch.advantages = group_advantages(batch.rewards, batch.group_size)
    assert len(set(batch.response_mask.sum(-1).tolist())) > 1   # lengths differ: seq_mean bites
    want = _reference_grads(ckpt, batch, loss_agg)
    for split in ({"micro_batch_size": 8}, {"micro_batch_size": 3}, {"micro_batch_size": 1},
                  {"micro_batch_tokens": 16}):
        got = _actor_grads(ckpt, batch, loss_agg, **split)
        for name, grad in got.items():
            assert torch.allclose(grad, want[name], atol=1e-6, rtol=1e-5), (split, name)


def test_the_aggregations_differ_where_lengths_differ(ckpt):
    batch = make_batch(seed=7)
    batch.advantages = group_advantages(batch.rewards, batch.group_size)
    grads = [_actor_grads(ckpt, batch, agg, micro_batch_size=8) for agg in LOSS_AGGREGATIONS]
    name = next(iter(grads[0]))
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not torch.allclose(grads[a][name], grads[b][name])


def test_unscaled_advantages_reach_the_update(ckpt):
    batch = make_batch(seed=8)
    seen = []
    for scale in (True, False):
        actor = Actor(ckpt, actor=ActorConfig(scale_advantages=scale), dtype="float32")
        actor.update(batch)
        seen.append(batch.advantages.clone())
    assert torch.equal(seen[0], group_advantages(batch.rewards, batch.group_size))
    assert torch.equal(seen[1], group_advantages(batch.rewards, batch.group_size, scale=False))
    assert not torch.equal(seen[0], seen[1])


def test_dr_grpo_without_a_max_response_len_is_refused(ckpt):
    from handoff.errors import HandoffError

    with pytest.raises(HandoffError, match="max_response_len"):
        Actor(ckpt, actor=ActorConfig(loss_agg="seq_mean_token_sum_norm"), dtype="float32")
