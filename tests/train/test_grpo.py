"""GRPO math on hand-computed cases: advantages, clipping, k3 KL, log-probs, aggregation."""

import math

import pytest
import torch

from handoff.train import grpo


def test_all_equal_rewards_give_zero_advantages():
    adv = grpo.group_advantages(torch.tensor([0.7, 0.7, 0.7, 0.0, 0.0, 0.0]), group_size=3)
    assert torch.equal(adv, torch.zeros(6))


def test_group_advantages_by_hand():
    # group 1: mean 0.5, sample std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866; group 2: [1, 3]
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4, eps=0.0)
    assert torch.allclose(adv, torch.tensor([1, -1, 1, -1]) * math.sqrt(3) / 2)
    adv = grpo.group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), group_size=2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2), 0, 0]))
    assert torch.equal(grpo.group_advantages(torch.tensor([1.0, 5.0]), 1), torch.zeros(2))


@pytest.mark.parametrize("ratio, adv, loss, clipped", [
    (1.5, 1.0, -1.2, 1.0),    # good sample pushed past 1 + high: the bound binds
    (1.5, -1.0, 1.5, 0.0),    # bad sample with a large ratio: the pessimistic unclipped term
    (0.5, 1.0, -0.5, 0.0),    # good sample below 1 - low: unclipped is the max
    (0.5, -1.0, 0.8, 1.0),    # bad sample pushed below 1 - low: the bound binds
    (1.2, 1.0, -1.2, 0.0),    # exactly at the bound: equal terms, not counted as clipped
    (1.1, 2.0, -2.2, 0.0),    # inside the trust region
])
def test_clipping_engages_at_the_bounds(ratio, adv, loss, clipped):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64)
    pg, was_clipped = grpo.clipped_surrogate(logp, torch.zeros_like(logp),
                                             torch.tensor([adv], dtype=torch.float64), 0.2, 0.2)
    assert pg.item() == pytest.approx(loss, abs=1e-9)
    assert was_clipped.item() == clipped


def test_clip_higher_is_asymmetric():
    logp = torch.tensor([[math.log(1.25)]])
    pg, clipped = grpo.clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.28)
    assert pg.item() == pytest.approx(-1.25) and clipped.item() == 0.0
    pg, clipped = grpo.clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.2)
    assert pg.item() == pytest.approx(-1.2) and clipped.item() == 1.0


def test_k3_kl_is_zero_for_identical_policies_and_matches_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.1, 0.9]]))
    assert torch.equal(grpo.kl_k3(logp, logp), torch.zeros_like(logp))
    # r = log(0.25 / 0.5): exp(r) - r - 1 = 0.5 + ln 2 - 1
    kl = grpo.kl_k3(torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]])))
    assert kl.item() == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    assert (grpo.kl_k3(torch.randn(4, 5), torch.randn(4, 5)) >= 0).all()


def test_token_logprobs_and_entropy_by_hand():
    # V = 2; position 0 predicts token 1; position 1 predicts token 2
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0], [9.0, 9.0]]])
    ids = torch.tensor([[0, 1, 0]])
    logp = grpo.token_logprobs(logits, ids)
    assert torch.allclose(logp, torch.tensor([[0.0, math.log(0.75), math.log(0.5)]]))
    ent = grpo.token_entropy(logits)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.allclose(ent, torch.tensor([[0.0, h, math.log(2)]]))


def test_loss_sums_combine_terms_over_the_mask_only():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.25, 0.5]]))       # ratio 1, 2, 1
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5]]))       # k3 = 0.5 + ln2 - 1, 0, 0
    ent = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])                  # the third token is padding
    s = grpo.grpo_loss_sums(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2,
                            ref_logp_BT=ref, kl_coef=0.1, entropy_BT=ent, entropy_coef=0.01)
    kl0 = 0.5 + math.log(2) - 1
    pg = -1.0 + -1.2                                        # the second token is clipped
    assert s.pg_loss.item() == pytest.approx(pg)
    assert s.kl.item() == pytest.approx(kl0)
    assert s.entropy.item() == pytest.approx(3.0)
    assert s.clipped.item() == 1.0 and s.tokens.item() == 2.0
    assert s.loss.item() == pytest.approx(pg + 0.1 * kl0 - 0.01 * 3.0)


def test_zero_advantage_and_identical_policies_give_zero_loss_and_gradient():
    logp = torch.randn(2, 4, requires_grad=True)
    s = grpo.grpo_loss_sums(logp, logp.detach(), torch.zeros(2), torch.ones(2, 4),
                            clip_low=0.2, clip_high=0.2, ref_logp_BT=logp.detach(), kl_coef=0.5)
    s.loss.backward()
    assert s.loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 4))


def test_unscaled_advantages_are_the_centred_rewards():
    # Dr. GRPO: [1, 0, 1, 0] has mean 0.5 -> +-0.5, not divided by the std (0.577)
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4, scale=False)
    assert torch.equal(adv, torch.tensor([0.5, -0.5, 0.5, -0.5]))
    adv = grpo.group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), group_size=2, scale=False)
    assert torch.equal(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0]))


def _aggregated(loss_agg, *, max_response_len=None):
    # logp == old: ratio 1, so a token's loss is -A_b - entropy_bt (entropy_coef = 1).
    # Sequence 0: A = -2, entropies 1, 0, 0 -> losses 1, 2, 2 (sum 5 over 3 tokens);
    # sequence 1: A = -6, entropy 3 -> loss 3 (sum 3 over 1 token). The 5s are padding.
    logp = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 0.0, 0.0, 5.0], [3.0, 5.0, 5.0, 5.0]])
    s = grpo.grpo_loss_sums(logp, logp, torch.tensor([-2.0, -6.0]), mask, clip_low=0.2,
                            clip_high=0.2, entropy_BT=ent, entropy_coef=1.0,
                            weight_BT=grpo.aggregation_weights(mask, loss_agg))
    denominator = grpo.aggregation_denominator(loss_agg, num_tokens=4.0, num_sequences=2.0,
                                               max_response_len=max_response_len)
    return s.objective.item() / denominator, s.loss.item()


def test_loss_aggregations_by_hand():
    # token_mean (DAPO): (5 + 3) / 4 tokens = 2
    assert _aggregated("token_mean")[0] == pytest.approx(2.0)
    # seq_mean (GRPO): (5/3 + 3/1) / 2 sequences = 7/3
    assert _aggregated("seq_mean")[0] == pytest.approx(7 / 3)
    # seq_mean_token_sum_norm (Dr. GRPO), L = 4: (5/4 + 3/4) / 2 sequences = 1
    assert _aggregated("seq_mean_token_sum_norm", max_response_len=4)[0] == pytest.approx(1.0)
    # the loss sum (the `loss` metric's numerator) is the same under every aggregation
    assert _aggregated("seq_mean")[1] == _aggregated("token_mean")[1] == pytest.approx(8.0)
    with pytest.raises(ValueError, match="max_response_len"):
        _aggregated("seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="token_mean, seq_mean"):
        grpo.aggregation_weights(torch.ones(1, 1), "sum")


def test_default_aggregation_is_the_previous_token_mean_bit_for_bit():
    # The previous code: backward on (loss_BT * mask).sum() * world / max(tokens, 1).
    g = torch.Generator().manual_seed(0)
    logp, old, ref, ent = (torch.randn(6, 9, generator=g) * 0.3 for _ in range(4))
    adv, mask = torch.randn(6, generator=g), (torch.rand(6, 9, generator=g) > 0.4).float()
    world = 2
    pg, _ = grpo.clipped_surrogate(logp, old, adv, 0.2, 0.28)
    loss_BT = pg + 0.05 * grpo.kl_k3(logp, ref) - 0.01 * ent
    previous = (loss_BT * mask).sum() * (world / max(float(mask.sum()), 1.0))
    s = grpo.grpo_loss_sums(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, ref_logp_BT=ref,
                            kl_coef=0.05, entropy_BT=ent, entropy_coef=0.01,
                            weight_BT=grpo.aggregation_weights(mask, "token_mean"))
    now = s.objective * (world / grpo.aggregation_denominator(
        "token_mean", num_tokens=float(mask.sum()), num_sequences=6.0))
    assert torch.equal(now, previous)
