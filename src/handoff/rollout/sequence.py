"""One sample being generated (a Sequence) and what `Engine.generate` returns.

A prompt asked with n > 1 becomes n Sequences that share the prompt's KV blocks through the
prefix cache. A Sequence carries its tokens (prompt + generated), the log-prob of every
sampled token, its block table (KV block ids, in order) and its row in the block manager's
block-table array, which is what the decode step reads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from handoff.rollout.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Mutable state of one sample; the scheduler and block manager update it in place."""

    __slots__ = ("seq_id", "request_index", "sample_index", "params", "token_ids",
                 "num_tokens", "num_prompt_tokens", "logprobs", "stop_ids", "key", "status",
                 "finish_reason", "block_table", "num_cached_tokens", "row", "max_tokens")

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, *,
                 request_index: int, sample_index: int, key: int, stop_ids: frozenset[int]):
        self.seq_id = seq_id
        self.request_index = request_index
        self.sample_index = sample_index
        self.params = params
        self.max_tokens = (params.sample_max_tokens[sample_index] if params.sample_max_tokens
                           else params.max_tokens)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.logprobs: list[float] = []
        self.stop_ids = stop_ids
        self.key = key
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.row = -1

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"generated={self.num_generated}, status={self.status.value})")


@dataclass
class SampleOutput:
    """One completion: generated token ids (stop token included), their log-probs, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop/eos token was sampled) or "length" (max_tokens / max_model_len)


@dataclass
class RequestOutput:
    """All n completions of one prompt, in sample order."""

    prompt_token_ids: list[int]
    outputs: list[SampleOutput] = field(default_factory=list)
