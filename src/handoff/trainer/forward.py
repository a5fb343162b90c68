"""One micro-batch through the model: per-token log-probs (and entropy) of its tokens.

    logp, ent = token_forward(module, mb, chunk_tokens=2048, with_entropy=True,
                              entropy_grad=False)

`mb` is a train.packing micro-batch (packed or right-padded); the values come back in its
per-token layout ([T, 1] packed, [b, w] padded), each at the position of the token it scores
(grpo's convention: 0 where there is no prediction). chunk_tokens > 0 scores the tokens with
train.logprobs' chunked head (no [tokens x vocab] fp32 logits); 0 materializes the logits
and uses grpo.token_logprobs / token_entropy, the reference path. Entropy carries a
gradient only with `entropy_grad` (actor.entropy_coef > 0); otherwise it is a metric.
"""

from __future__ import annotations

import torch

from handoff.trainer import grpo
from handoff.trainer.logprobs import HEAD_RANGE, next_token_targets, shift_to_tokens, token_head

# The input shapes token_forward has run in this process.
_shapes_run: set[tuple[int, ...]] = set()


def new_shapes_first(micro_batches: list) -> tuple[list, int]:
    """(micro-batch, real) pairs with the first of each input shape token_forward has not run
    in this process moved to the front, and how many were moved. Their first launch can load
    kernels and allocate new block sizes, which wait for copies in flight (docs/PERF.md, "The
    streamed switch"): run first, they go before any copy is queued beside the pass."""
    new, rest, seen = [], [], set(_shapes_run)
    for pair in micro_batches:
        shape = tuple(pair[0].input_ids.shape)
        (rest if shape in seen else new).append(pair)
        seen.add(shape)
    return new + rest, len(new)


def token_forward(module: torch.nn.Module, mb, *, chunk_tokens: int, with_entropy: bool,
                  entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    kwargs = mb.model_kwargs()
    ids = kwargs["input_ids"]
    _shapes_run.add(tuple(ids.shape))
    if chunk_tokens > 0:
        with token_head(module, next_token_targets(ids), chunk_tokens=chunk_tokens,
                        with_entropy=with_entropy):
            out = module(**kwargs, use_cache=False).logits
        logp = shift_to_tokens(out[..., 0])
        ent = shift_to_tokens(out[..., 1]) if with_entropy else None
        if ent is not None and not entropy_grad:
            ent = ent.detach()
    else:
        logits = module(**kwargs, use_cache=False).logits
        with torch.profiler.record_function(HEAD_RANGE):
            logp = grpo.token_logprobs(logits, ids)
            ent = None
            if with_entropy:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    ent = grpo.token_entropy(logits if entropy_grad else logits.detach())
        del logits
    return mb.per_token(logp), (mb.per_token(ent) if ent is not None else None)
