"""The rollout batch the trainer consumes: prompt + response token rows with their rewards.

    batch = RolloutBatch.from_tokens(prompts, responses, rewards, group_size=4, pad_id=259)
    batch.old_logprobs, _ = actor.log_probs(batch)
    batch.ref_logprobs, _ = ref.log_probs(batch)
    metrics = actor.update(batch)

Rows are right-padded; a prompt's `group_size` samples are consecutive rows. Shape legend:
B sequences, T tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from handoff.errors import HandoffError


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor                    # [B, T] int64, prompt + response + padding
    attention_mask: torch.Tensor               # [B, T] int64, 1 on prompt and response tokens
    response_mask: torch.Tensor                # [B, T] float32, 1 on response tokens only
    rewards: torch.Tensor                      # [B] float32
    group_size: int                            # samples per prompt (consecutive rows)
    old_logprobs: torch.Tensor | None = None   # [B, T] float32, the policy that sampled
    ref_logprobs: torch.Tensor | None = None   # [B, T] float32, the reference model
    advantages: torch.Tensor | None = None     # [B] float32, set by the actor from rewards

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        for name in ("attention_mask", "response_mask"):
            if tuple(getattr(self, name).shape) != (b, t):
                raise HandoffError(f"RolloutBatch.{name} has shape {tuple(getattr(self, name).shape)}"
                                   f" but input_ids is {(b, t)}: build both from the same rows")
        if self.rewards.shape != (b,):
            raise HandoffError(f"RolloutBatch.rewards has shape {tuple(self.rewards.shape)}, "
                               f"expected ({b},): one reward per row")
        if t > 1 and bool((self.attention_mask[:, 1:] > self.attention_mask[:, :-1]).any()):
            raise HandoffError("RolloutBatch rows must be right-padded (attention_mask 1...1 0...0): "
                               "build the batch with RolloutBatch.from_tokens")
        if self.group_size < 1 or b % self.group_size != 0:
            raise HandoffError(f"batch of {b} rows is not a whole number of groups of "
                               f"{self.group_size}: generate rollout.n samples for every prompt")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> "RolloutBatch":
        """Rows [start, stop) as a batch (views); group_size is kept only if it still divides."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]
        n = stop - start
        return dataclasses.replace(
            self, **{f.name: cut(getattr(self, f.name)) for f in dataclasses.fields(self)
                     if f.name != "group_size"},
            group_size=self.group_size if n % self.group_size == 0 else 1)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)})

    @classmethod
    def from_tokens(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                    rewards: Sequence[float], *, group_size: int, pad_id: int,
                    max_len: int | None = None) -> "RolloutBatch":
        """Concatenate each prompt with its response, right-pad to the longest row."""
        if not (len(prompts) == len(responses) == len(rewards)):
            raise HandoffError(f"{len(prompts)} prompts, {len(responses)} responses and "
                               f"{len(rewards)} rewards: pass one prompt and reward per response "
                               "(repeat each prompt for its n samples)")
        if any(len(p) == 0 for p in prompts):
            raise HandoffError("an empty prompt has no token to predict the response from: "
                               "give every prompt at least one token (e.g. BOS)")
        rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
        t = max_len or max(len(r) for r in rows)
        if any(len(r) > t for r in rows):
            raise HandoffError(f"a row of {max(map(len, rows))} tokens exceeds max_len={t}: "
                               "raise max_len or truncate responses")
        b = len(rows)
        input_ids = torch.full((b, t), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((b, t), dtype=torch.long)
        response_mask = torch.zeros((b, t), dtype=torch.float32)
        for i, (p, row) in enumerate(zip(prompts, rows)):
            input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, :len(row)] = 1
            response_mask[i, len(p):len(row)] = 1
        return cls(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                   rewards=torch.tensor(list(rewards), dtype=torch.float32), group_size=group_size)
