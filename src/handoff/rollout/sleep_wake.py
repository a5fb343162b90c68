"""The engine's side of the handoff: sleep, wake_up and new weights from the trainer.

Sleep levels: 0 pauses generation only; 1 backs the weights up to pinned host memory and
drops the KV; 2 drops both (the trainer sends new weights anyway), and generation is refused
until `load_weights` has refilled every parameter; an adapter is dropped with the weights
(its A rows share their buffer) until the next `load_adapter`. `sleep_kv` drops the KV only
(LoRA on a base the trainer shares). `EngineSleepWake` is a part of `Engine`
(rollout/engine.py), which owns the state these methods use.
"""

from __future__ import annotations

from typing import Iterable

import torch

from handoff.errors import HandoffError

TAGS = ("weights", "kv_cache")   # the engine's memory regions, in the order they wake


class EngineSleepWake:
    """Sleep, wake and weight updates of the engine (mixed into `Engine`)."""

    def sleep(self, level: int) -> None:
        """0: pause; 1: weights -> pinned host, KV dropped; 2: weights and KV dropped."""
        if level not in (0, 1, 2):
            raise HandoffError(f"sleep level={level} is not supported: use 0, 1 or 2")
        self._paused = True
        if level == 0:
            return
        self.pool.sleep(["weights"], level=level)
        self.sleep_kv()
        if level == 2:
            self._missing_weights = self.model.weight_keys()

    def sleep_kv(self) -> None:
        """Drop the KV pool only, the weights stay mapped: under LoRA on a shared base they are
        the trainer's frozen base too (trainer/lora.py); `wake_up(["kv_cache"])` maps it back."""
        self._paused = True
        if self.pool.is_awake("kv_cache"):
            self.blocks.reset_prefix_cache()
        self.pool.sleep(["kv_cache"], level=2)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map the regions of `tags` again (default both)."""
        tags = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise HandoffError(f"unknown engine tags {unknown}: use {list(TAGS)}")
        dropped = "weights" in tags and not self.pool.is_awake("weights") and self._missing_weights
        self.pool.wake_up([t for t in TAGS if t in tags])
        if dropped and self.lora is not None:
            self.lora.clear()   # a level-2 sleep dropped the A rows kept beside the weights
        if "kv_cache" in tags:
            self.blocks.reset_prefix_cache()
        self._paused = not all(self.pool.is_awake(t) for t in TAGS)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, full tensor) pairs into the engine layout.

        weights_version grows by one per update: consecutive calls between two `generate`s
        (the buckets of one sync) count as a single update.
        """
        if not self.pool.is_awake("weights"):
            raise HandoffError("load_weights while the weights region sleeps: call "
                               "wake_up(['weights']) first")
        self._missing_weights -= self.model.load_weights(weights)
        if not self._updating_weights:  # the buckets of one sync make one new version
            self.weights_version += 1
            self._updating_weights = True
        if self.pool.is_awake("kv_cache"):
            self.blocks.reset_prefix_cache()  # cached KV was computed by the old weights

    def export_weight(self, hf_name: str) -> torch.Tensor:
        """The engine's copy of HF tensor `hf_name` (a view: fused rows, or the tied embedding);
        under TP, this rank's part of it (compare with `weight_shard` of the full tensor)."""
        return self.model.export(self._tied(hf_name))

    def weight_shard(self, hf_name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of the full tensor `hf_name` this rank keeps (all of it at TP = 1)."""
        return self.model.select(self._tied(hf_name), full)

    def _tied(self, hf_name: str) -> str:
        if hf_name == "lm_head.weight" and self.model.lm_head is None:
            return "model.embed_tokens.weight"
        return hf_name

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (call after weights change)."""
        self.blocks.reset_prefix_cache()

