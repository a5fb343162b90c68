"""Log-probs and entropy of the sampled tokens without [tokens x vocab] fp32 logits.

    install_token_head(model)                    # once, after loading
    with token_head(model, targets_BT, chunk_tokens=2048, with_entropy=True):
        out_BT2 = model(input_ids=ids_BT).logits  # [..., 0] log-prob, [..., 1] entropy

The full path (grpo.token_logprobs / token_entropy on the model's logits) keeps the bf16
logits, their fp32 copy and the softmax of every token: ~18 bytes x vocabulary per token,
2.7 MB/token for Qwen3's 151,936 (44 GB for a 16K-token micro-batch). Here the lm_head runs
inside an autograd Function, `chunk_tokens` tokens at a time: each chunk's logits are
computed in the weight's dtype (as nn.Linear does), upcast, reduced to log-prob and entropy,
and dropped. Backward recomputes each chunk's logits (one more [chunk x H] x [H x V] GEMM,
~1/3 more head FLOPs, a few % of a step) and forms the logits' gradient
  d logp / d logit_v   = onehot(target)_v - p_v
  d entropy / d logit_v = -p_v (log p_v + entropy)
in fp32, casts it to the weight's dtype and runs the two GEMMs (grad of hidden; grad of the
weight accumulated in fp32 over chunks, cast once). So the numbers are the full path's up
to GEMM blocking and the weight gradient's single final rounding.

The head is swapped in on the lm_head module instance itself, inside the model's own forward:
FSDP2 has the root's parameters (embeddings, tied head) unsharded exactly then, and the
result is the model's output, so FSDP's backward hooks see it as they see the logits.
liger-kernel's fused linear cross-entropy was considered: it returns per-token losses but no
entropy, and computes gradients during the forward for a scalar loss; the GRPO loss needs
per-token log-probs with arbitrary upstream gradients (ratio, clip, KL) plus entropy.
Shape legend: B rows, T tokens, N = B x T flattened tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

HEAD_RANGE = "handoff.logprob_head"   # the profiler range benches attribute head time by


def _upcast(dtype: torch.dtype) -> torch.dtype:
    """The reductions' dtype: fp32 for bf16/fp16/fp32 weights (fp64 stays fp64 in tests)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(logits_CV: torch.Tensor, target_C: torch.Tensor, with_entropy: bool):
    logz_C = torch.logsumexp(logits_CV, dim=-1)
    logp_C = logits_CV.gather(-1, target_C[:, None])[:, 0] - logz_C
    if not with_entropy:
        return logz_C, logp_C, None
    probs_CV = torch.softmax(logits_CV, dim=-1)
    return logz_C, logp_C, logz_C - (probs_CV * logits_CV).sum(-1)


class ChunkedTokenLogProbs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], target [N]) -> (log-prob [N], entropy [N] or empty),
    in fp32 (see _upcast)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, target_N, chunk: int, with_entropy: bool):
        with torch.profiler.record_function(HEAD_RANGE):
            return ChunkedTokenLogProbs._forward(ctx, hidden_NH, weight_VH, target_N, chunk,
                                                 with_entropy)

    @staticmethod
    def _forward(ctx, hidden_NH, weight_VH, target_N, chunk: int, with_entropy: bool):
        n, fp = hidden_NH.shape[0], _upcast(weight_VH.dtype)
        logp_N = torch.empty(n, dtype=fp, device=hidden_NH.device)
        ent_N = torch.empty(n if with_entropy else 0, dtype=fp, device=hidden_NH.device)
        logz_N = torch.empty_like(logp_N)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            logits_CV = (hidden_NH[lo:hi] @ weight_VH.t()).to(fp)
            logz_N[lo:hi], logp_N[lo:hi], ent = _chunk_stats(logits_CV, target_N[lo:hi],
                                                            with_entropy)
            if with_entropy:
                ent_N[lo:hi] = ent
            del logits_CV, ent
        ctx.save_for_backward(hidden_NH, weight_VH, target_N, logz_N,
                              ent_N if with_entropy else logz_N)
        ctx.chunk, ctx.with_entropy = chunk, with_entropy
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_ent_N):
        with torch.profiler.record_function(HEAD_RANGE):
            return ChunkedTokenLogProbs._backward(ctx, grad_logp_N, grad_ent_N)

    @staticmethod
    def _backward(ctx, grad_logp_N, grad_ent_N):
        hidden_NH, weight_VH, target_N, logz_N, ent_N = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_ent_N = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp_N is None and grad_ent_N is None:
            return (torch.zeros_like(hidden_NH) if need_h else None,
                    torch.zeros_like(weight_VH) if need_w else None, None, None, None)
        n, chunk = hidden_NH.shape[0], ctx.chunk
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        grad_w = torch.zeros(weight_VH.shape, device=weight_VH.device,
                             dtype=_upcast(weight_VH.dtype)) if need_w else None
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            h_CH = hidden_NH[lo:hi]
            logp_CV = (h_CH @ weight_VH.t()).to(logz_N.dtype).sub_(logz_N[lo:hi, None])
            grad_CV = logp_CV.exp()                                    # p, becomes the grad
            if grad_ent_N is not None:
                # d/dlogit of g_logp * logp + g_ent * H = -p (g_logp + g_ent (log p + H))
                # (+ g_logp at the target)
                coef_CV = logp_CV.add_(ent_N[lo:hi, None]).mul_(grad_ent_N[lo:hi, None])
                if grad_logp_N is not None:
                    coef_CV.add_(grad_logp_N[lo:hi, None])
                grad_CV.mul_(coef_CV).neg_()
            else:
                grad_CV.mul_(grad_logp_N[lo:hi, None]).neg_()
            del logp_CV
            if grad_logp_N is not None:
                grad_CV.scatter_add_(-1, target_N[lo:hi, None], grad_logp_N[lo:hi, None])
            grad_CV = grad_CV.to(weight_VH.dtype)
            if need_h:
                grad_h[lo:hi] = grad_CV @ weight_VH
            if need_w:
                _accumulate(grad_w, grad_CV.t(), h_CH)
            del grad_CV
        return (grad_h, grad_w.to(weight_VH.dtype) if need_w else None, None, None, None)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32 or wider) += a @ b: in place in one GEMM when the dtypes agree, or on CUDA
    with addmm's fp32 out_dtype for bf16/fp16 inputs (torch >= 2.8); else via a temporary."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError):
            pass
    acc += (a @ b).to(acc.dtype)


def chunked_token_logprobs(hidden_NH: torch.Tensor, weight_VH: torch.Tensor,
                           target_N: torch.Tensor, *, chunk_tokens: int,
                           with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target_n | hidden_n) [N] and the entropy [N] (None without), fp32, chunked."""
    logp_N, ent_N = ChunkedTokenLogProbs.apply(hidden_NH, weight_VH, target_N, chunk_tokens,
                                               with_entropy)
    return logp_N, (ent_N if with_entropy else None)


# ---- the swap on the model's lm_head -------------------------------------------------------

def install_token_head(model: torch.nn.Module) -> None:
    """Give `model.lm_head` a switchable forward: plain nn.Linear unless token_head() is on."""
    head = model.lm_head
    if getattr(head, "_handoff_request", False) is not False:
        return
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("the chunked log-prob head assumes an lm_head without bias: "
                                  "set actor.logprob_chunk_tokens=0")
    head._handoff_request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self._handoff_request
        if req is None:
            return F.linear(hidden, self.weight, self.bias)
        targets, chunk, with_entropy = req
        h = hidden.shape[-1]
        logp, ent = chunked_token_logprobs(hidden.reshape(-1, h), self.weight,
                                           targets.reshape(-1), chunk_tokens=chunk,
                                           with_entropy=with_entropy)
        parts = [logp] + ([ent] if with_entropy else [])
        # Stacked from shaped parts: FSDP2 hooks the output, which must not be a view.
        return torch.stack([p.view(hidden.shape[:-1]) for p in parts], dim=-1)

    head.forward = types.MethodType(forward, head)


@contextmanager
def token_head(model: torch.nn.Module, targets: torch.Tensor, *, chunk_tokens: int,
               with_entropy: bool) -> Iterator[None]:
    """While on, the model's `.logits` are [..., 1 or 2]: the log-prob of `targets` (same
    shape as input_ids: the token each position predicts) and the entropy there."""
    head = model.lm_head
    assert getattr(head, "_handoff_request", False) is None, "install_token_head(model) first"
    head._handoff_request = (targets, chunk_tokens, with_entropy)
    try:
        yield
    finally:
        head._handoff_request = None


def next_token_targets(input_ids_BT: torch.Tensor) -> torch.Tensor:
    """The token each position predicts: input_ids shifted left by one (the last position's
    target is a stand-in; its result is dropped)."""
    return torch.cat([input_ids_BT[:, 1:], input_ids_BT[:, :1]], dim=1)


def shift_to_tokens(per_position_BT: torch.Tensor) -> torch.Tensor:
    """Results per predicting position -> per predicted token (grpo's convention: index t
    holds the value for token t, 0 at t = 0)."""
    return F.pad(per_position_BT[:, :-1], (1, 0))
