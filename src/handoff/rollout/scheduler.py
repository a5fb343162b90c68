"""Continuous batching: which sequences run in the next step, prefill or decode.

A step is either a prefill (admit waiting sequences while blocks, `max_num_seqs` and the token
budget allow; their prompts, minus cached prefix blocks, run in one packed forward) or a decode
(every running sequence advances one token). Prefill goes first whenever something can be
admitted, so new work joins the running batch between decode steps.

When a decode step needs a block and none is free, the most recently admitted sequence is
preempted: its blocks are released (they stay in the prefix cache) and it returns to the head
of the queue, to be recomputed by a later prefill. The engine guarantees one sequence of
`max_model_len` tokens fits the pool, so the head of the batch always makes progress.
"""

from __future__ import annotations

from collections import deque

from handoff.rollout.blocks import BlockManager
from handoff.rollout.sequence import Sequence, Status


class Scheduler:
    """Waiting queue + running batch over one BlockManager."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.peak_running = 0   # most sequences running at once (the engine resets it per call)
        self.blocks_short = False   # a step found too few free blocks (the engine clears it)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill."""
        admitted = self._admit()
        if admitted:
            return admitted, True
        return self._reserve_decode(), False

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # The whole length is the budget bound (cached blocks are only known after allocate).
            if admitted and num_tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            if not self.blocks.allocate(seq):
                self.blocks_short = True
                break
            num_tokens += seq.num_tokens - seq.num_cached_tokens
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        self.peak_running = max(self.peak_running, len(self.running))
        return admitted

    def _reserve_decode(self) -> list[Sequence]:
        running = self.running
        i = 0
        while i < len(running):
            seq = running[i]
            if self.blocks.reserve_decode_slot(seq):
                i += 1
                continue
            victim = running.pop()  # from the back: the front already holds its slot
            self._preempt(victim)
            self.blocks_short = True
        return list(running)

    def reserve_ahead(self) -> list[Sequence] | None:
        """The next decode batch, staged while the current decode step (all running
        sequences) is still sampling: every sequence that will not end by length, with room
        for one more token. A sequence that samples a stop token now is in it too; its
        token from that step is dropped. None when the next step must wait for this one's
        tokens: sequences wait to be admitted, or a block is short (no preemption here)."""
        if self.waiting:
            return None
        batch = [s for s in self.running if not self._ends_by_length(s, ahead=1)]
        if not batch:
            return None
        if not all(self.blocks.reserve_decode_slot(s, ahead=1) for s in batch):
            self.blocks_short = True
            return None
        return batch

    def _ends_by_length(self, seq: Sequence, ahead: int = 0) -> bool:
        num_tokens = seq.num_tokens + ahead
        return (num_tokens - seq.num_prompt_tokens >= seq.max_tokens
                or num_tokens >= self.max_model_len)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free_seq(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list[float]) -> list[Sequence]:
        """Append each sampled token, finish sequences that stop; returns the finished ones."""
        finished = []
        for seq, token, logprob in zip(seqs, token_ids, logprobs):
            if seq.status is not Status.RUNNING:  # stopped in the step before this early one
                continue
            self.blocks.register_filled_block(seq)
            seq.append(token, logprob)
            if token in seq.stop_ids:
                seq.finish_reason = "stop"
            elif self._ends_by_length(seq):
                seq.finish_reason = "length"
            else:
                continue
            seq.status = Status.FINISHED
            self.blocks.free_seq(seq)
            finished.append(seq)
        if finished:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return finished

    def abort_all(self) -> list[Sequence]:
        """Drop every sequence (after an error mid-step); frees their blocks."""
        dropped = list(self.running) + list(self.waiting)
        for seq in self.running:
            self.blocks.free_seq(seq)
            seq.status = Status.FINISHED
        self.running = []
        self.waiting.clear()
        return dropped
