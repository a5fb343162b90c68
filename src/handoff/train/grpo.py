"""GRPO math as pure functions: group advantages, per-token log-probs, clipped surrogate, KL,
and the loss aggregations named as TRL and verl name them (`actor.loss_agg`).

Nothing here knows about FSDP or devices; the actor calls these on each micro-batch and the
tests check them on hand-computed cases.

Loss aggregation over one optimizer step's sequences (all micro-batches, all ranks), with
l_bt the per-token loss, |o_b| sequence b's response tokens, S the sequences, L the longest
response allowed (rollout.max_tokens):
  token_mean               sum_bt l_bt / sum_b |o_b|          (DAPO; verl token-mean)
  seq_mean                 (1/S) sum_b (sum_t l_bt / |o_b|)   (the GRPO paper; verl
                                                               seq-mean-token-mean)
  seq_mean_token_sum_norm  (1/S) sum_b (sum_t l_bt / L)       (Dr. GRPO; TRL dr_grpo)
A micro-batch contributes sum_bt l_bt * w_bt (`aggregation_weights`) divided by the step's
`aggregation_denominator`, so the step's loss is the same however it is split.

Shape legend: B sequences, T tokens (prompt + response, right-padded), V vocabulary,
G prompts (groups), N samples per prompt (B = G * N, a group's samples are consecutive).

Position convention: `logp_BT[b, t]` is log p(input_ids[b, t] | input_ids[b, :t]); position 0
has no prediction and holds 0. Response tokens never sit at position 0 (prompts are non-empty).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


LOSS_AGGREGATIONS = ("token_mean", "seq_mean", "seq_mean_token_sum_norm")


def group_advantages(rewards_B: torch.Tensor, group_size: int, eps: float = 1e-6, *,
                     scale: bool = True) -> torch.Tensor:
    """(reward - group mean) / (group std + eps), std with Bessel's correction; 0 when N == 1.
    scale=False (Dr. GRPO): reward - group mean, not divided by the std.

    A group whose rewards are all equal gets advantage 0 exactly (the numerator is 0), so it
    contributes nothing but its KL and entropy terms.
    """
    assert rewards_B.numel() % group_size == 0, "batch size must be a multiple of the group size"
    rewards_GN = rewards_B.float().view(-1, group_size)
    centred_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if group_size == 1:
        return torch.zeros_like(rewards_B, dtype=torch.float32)
    if not scale:
        return centred_GN.view(-1)
    std_G1 = rewards_GN.std(dim=1, keepdim=True)
    adv_GN = torch.where(centred_GN == 0, 0.0, centred_GN / (std_G1 + eps))
    return adv_GN.view(-1)


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Log-prob of each token under the logits of the position before it: [B, T] fp32, 0 at t=0."""
    logits_BTV = logits_BTV[:, :-1].float()
    logz_BT = torch.logsumexp(logits_BTV, dim=-1)
    picked_BT = logits_BTV.gather(-1, input_ids_BT[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked_BT - logz_BT, (1, 0))


def token_entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of the distribution that predicts each token: [B, T] fp32, 0 at t=0."""
    logits_BTV = logits_BTV[:, :-1].float()
    logz_BT = torch.logsumexp(logits_BTV, dim=-1)
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    return F.pad(logz_BT - (probs_BTV * logits_BTV).sum(-1), (1, 0))


def kl_k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(r) - r - 1 with r = ref - logp; >= 0."""
    log_ratio_BT = ref_logp_BT - logp_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1


def clipped_surrogate(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_B: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss max(-A r, -A clip(r, 1-low, 1+high)) and where the clip is what binds."""
    ratio_BT = torch.exp(logp_BT - old_logp_BT)
    adv_B1 = adv_B.unsqueeze(-1)
    unclipped_BT = -adv_B1 * ratio_BT
    clipped_BT = -adv_B1 * torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped_BT, clipped_BT), (clipped_BT > unclipped_BT).float()


def aggregation_weights(mask_BT: torch.Tensor, loss_agg: str) -> torch.Tensor | None:
    """Each response token's weight in the step's loss sum under `loss_agg` ([B, T], the
    whole batch's rows so a sequence split by packing keeps its weight); None: the mask
    itself (token_mean, seq_mean_token_sum_norm)."""
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg={loss_agg!r} is not one of {', '.join(LOSS_AGGREGATIONS)}")
    if loss_agg != "seq_mean":
        return None
    mask_BT = mask_BT.float()
    return mask_BT / mask_BT.sum(dim=1, keepdim=True).clamp(min=1.0)


def aggregation_denominator(loss_agg: str, *, num_tokens: float, num_sequences: float,
                            max_response_len: int | None = None) -> float:
    """What the step's weighted loss sum is divided by: its response tokens (token_mean), its
    sequences with a response (seq_mean), or those times L (seq_mean_token_sum_norm); counts
    over all micro-batches and ranks, at least 1."""
    if loss_agg == "token_mean":
        return max(num_tokens, 1.0)
    if loss_agg == "seq_mean":
        return max(num_sequences, 1.0)
    if loss_agg == "seq_mean_token_sum_norm":
        if not max_response_len:
            raise ValueError("loss_agg='seq_mean_token_sum_norm' divides by the longest "
                             "response allowed: pass max_response_len (rollout.max_tokens)")
        return max(num_sequences, 1.0) * max_response_len
    raise ValueError(f"loss_agg={loss_agg!r} is not one of {', '.join(LOSS_AGGREGATIONS)}")


@dataclass
class LossSums:
    """Sums over the response tokens of one micro-batch: divide by the token count for means.
    `objective` is what backward runs on: `loss` itself, or its sum under the aggregation's
    token weights (the step divides it by aggregation_denominator)."""

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clipped: torch.Tensor
    tokens: torch.Tensor
    objective: torch.Tensor

    def stacked(self) -> torch.Tensor:
        return torch.stack([self.loss.detach(), self.pg_loss, self.kl, self.entropy,
                            self.clipped, self.tokens]).float()

    NAMES = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "num_tokens")


def grpo_loss_sums(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_B: torch.Tensor,
                   mask_BT: torch.Tensor, *, clip_low: float, clip_high: float,
                   ref_logp_BT: torch.Tensor | None = None, kl_coef: float = 0.0,
                   entropy_BT: torch.Tensor | None = None, entropy_coef: float = 0.0,
                   weight_BT: torch.Tensor | None = None) -> LossSums:
    """Token sums of the GRPO loss pg + kl_coef * k3 - entropy_coef * entropy over `mask_BT`;
    `weight_BT` (aggregation_weights, 0 off the mask) weighs each token in `objective`
    (None: objective is the loss sum, token_mean's and seq_mean_token_sum_norm's numerator).
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    pg_BT, clipped_BT = clipped_surrogate(logp_BT, old_logp_BT, adv_B, clip_low, clip_high)
    loss_BT = pg_BT
    kl_sum = torch.zeros((), device=logp_BT.device)
    if kl_coef > 0:
        assert ref_logp_BT is not None, "kl_coef > 0 needs reference log-probs"
        kl_BT = kl_k3(logp_BT, ref_logp_BT)
        loss_BT = loss_BT + kl_coef * kl_BT
        kl_sum = (kl_BT.detach() * mask_BT).sum()
    ent_sum = torch.zeros((), device=logp_BT.device)
    if entropy_BT is not None:
        if entropy_coef > 0:
            loss_BT = loss_BT - entropy_coef * entropy_BT
        ent_sum = (entropy_BT.detach() * mask_BT).sum()
    loss = (loss_BT * mask_BT).sum()
    objective = loss if weight_BT is None else (loss_BT * weight_BT).sum()
    return LossSums(loss=loss, pg_loss=(pg_BT.detach() * mask_BT).sum(),
                    kl=kl_sum, entropy=ent_sum, clipped=(clipped_BT * mask_BT).sum(),
                    tokens=mask_BT.sum(), objective=objective)
