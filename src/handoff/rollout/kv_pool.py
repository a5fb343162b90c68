"""The engine's KV pool: how many blocks it gets, and, when elastic, how they follow memory.

A fixed pool (rollout.kv_pool=fixed) is sized once from gpu_memory_utilization (or
rollout.num_blocks) and mapped whole at every wake. An elastic one reserves the largest pool
the card could hold, maps what is free at each wake and grows, between engine steps, into
memory freed since (the streamed switch calls `grow_kv`). `EngineKVPool` is a part of
`Engine` (rollout/engine.py), which owns the state these methods use.
"""

from __future__ import annotations

import math
import warnings

import torch

from handoff.errors import HandoffError
from handoff.memory.elastic import ElasticArena, SimulatedDevice
from handoff.rollout.kv_sizing import blocks_for_one_sequence, kv_pool_blocks, kv_pool_budget_bytes
from handoff.units import GiB, fmt_bytes


class EngineKVPool:
    """Sizing and growing the engine's KV pool (mixed into `Engine`)."""

    def _overhead_bytes(self) -> int:
        """CUDA: the activation peak (profiled) and the decode graphs' pool, which stay
        outside the KV pool; 0 on CPU."""
        if self.device.type != "cuda":
            return 0
        cfg, runner = self.cfg, self.runner
        self.activation_peak_bytes = runner.profile_peak_bytes(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs)
        self.graph_reserve_bytes = runner.graph_reserve_bytes(cfg.max_num_seqs)
        return self.activation_peak_bytes + self.graph_reserve_bytes

    def _elastic_kv_cache(self, simulated: SimulatedDevice | None) -> int:
        """Reserve the largest pool the card could hold (every byte but the weights and the
        overhead), map what is free now, and adopt it as the KV pool; returns its blocks."""
        cfg, runner = self.cfg, self.runner
        if self.tp.size > 1:
            raise HandoffError("rollout.kv_pool=elastic runs one engine per card for now: use "
                               "rollout.kv_pool=fixed with parallel.tp > 1")
        layers = self.spec.num_layers
        slab_block = runner.kv_block_bytes() // (2 * layers)   # one layer's K of one block
        granule = ElasticArena.granule_bytes(self.device, simulated)
        per_granule = granule // math.gcd(granule, slab_block)  # blocks per whole granules
        overhead = self._overhead_bytes()
        on_cuda = self.device.type == "cuda"
        total = torch.cuda.mem_get_info(self.device)[1] if on_cuda else 0
        capacity = kv_pool_blocks(cfg, block_bytes=runner.kv_block_bytes(), on_cuda=on_cuda,
                                  max_model_len=self.max_model_len, elastic=True,
                                  hbm_bytes=total, weights_bytes=self.pool.region_bytes("weights"),
                                  overhead_bytes=overhead)
        capacity = max(-(-capacity // per_granule) * per_granule, per_granule)
        self._slab_block_bytes = slab_block
        self.kv_arena = ElasticArena(self.device, slabs=2 * layers,
                                     slab_bytes=capacity * slab_block, simulated=simulated)
        needed = blocks_for_one_sequence(self.max_model_len, cfg.block_size)
        self.pool.elastic("kv_cache", self.kv_arena, min_per_slab=needed * slab_block,
                          keep_free_bytes=overhead)
        storage = self.kv_arena.view(runner.kv_dtype, runner.kv_shape(capacity))
        runner.allocate_kv_cache(capacity, storage=storage)
        runner.reset_kv_cache(0, self._mapped_blocks())
        self._wake_blocks = self._mapped_blocks()
        return capacity

    def _mapped_blocks(self) -> int:
        """Blocks of the elastic pool backed by memory now."""
        return self.kv_arena.mapped_per_slab // self._slab_block_bytes

    def _after_elastic_wake(self) -> None:
        usable, last = self._mapped_blocks(), self._wake_blocks
        self.runner.reset_kv_cache(0, usable)
        self.blocks.reset_usable(usable)
        if usable < last:
            warnings.warn(f"the elastic KV pool mapped {usable} blocks at this wake, {last} at "
                          f"the last: {fmt_bytes((last - usable) * self.runner.kv_block_bytes())} "
                          "less was free (another owner, or memory still being copied off the "
                          "card); generation runs on less, and the pool grows if it is freed",
                          stacklevel=2)
        self._wake_blocks = usable

    def _num_blocks(self) -> int:
        cfg, runner = self.cfg, self.runner
        block_bytes = runner.kv_block_bytes()
        needed = blocks_for_one_sequence(self.max_model_len, cfg.block_size)
        sized_from_util = cfg.num_blocks is None and self.device.type == "cuda"
        total = free = own = overhead = 0
        if sized_from_util:
            overhead = self._overhead_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            own = self.pool.region_bytes("weights")
        num_blocks = kv_pool_blocks(cfg, block_bytes=block_bytes, on_cuda=self.device.type == "cuda",
                                    max_model_len=self.max_model_len, hbm_bytes=total,
                                    weights_bytes=own, overhead_bytes=overhead)
        if sized_from_util:
            budget = kv_pool_budget_bytes(cfg.gpu_memory_utilization, hbm_bytes=total,
                                          weights_bytes=own, overhead_bytes=overhead)
            if num_blocks < needed:
                raise HandoffError(
                    f"KV pool would be {budget / GiB:.2f} GiB at gpu_memory_utilization="
                    f"{cfg.gpu_memory_utilization}: engine weights take {own / GiB:.2f} GiB, the "
                    f"activation peak and decode graphs {overhead / GiB:.2f} GiB of "
                    f"{total / GiB:.1f} GiB; raise "
                    "rollout.gpu_memory_utilization or lower rollout.max_model_len / max_num_seqs")
            if num_blocks * block_bytes + overhead > free:
                raise HandoffError(
                    f"KV pool of {num_blocks * block_bytes / GiB:.2f} GiB plus "
                    f"{overhead / GiB:.2f} GiB of activation peak and decode graphs does not "
                    f"fit in the {free / GiB:.2f} GiB free now "
                    f"({(total - free - own) / GiB:.2f} GiB held by others): build the engine "
                    "before the trainer fills the card, offload it first, or lower "
                    "rollout.gpu_memory_utilization")
        # Every TP rank must schedule alike, hence hold the same number of blocks.
        num_blocks = self.tp.min_int(num_blocks, self.device)
        if num_blocks < needed:
            raise HandoffError(f"rollout.num_blocks={num_blocks} cannot hold one sequence of "
                               f"max_model_len={self.max_model_len} tokens ({needed} blocks of "
                               f"{cfg.block_size} incl. the null block): raise num_blocks or "
                               "lower rollout.max_model_len")
        return num_blocks

    @property
    def kv_mapped_bytes(self) -> int:
        """Device bytes of the KV pool backed by memory now (0 while it sleeps)."""
        if not self.pool.is_awake("kv_cache"):
            return 0
        return self.pool.region_bytes("kv_cache") if self.elastic else self.runner.kv_cache_bytes

    @property
    def kv_short(self) -> bool:
        """The pool has held generation back since this generate began or the pool last
        grew: a sequence could not be admitted, or a step found no block for a token."""
        return self.scheduler.blocks_short

    def grow_kv(self) -> int:
        """Back more of the KV pool with memory freed since the wake; returns the mapped
        bytes. A fixed pool (rollout.kv_pool=fixed) is mapped whole at its wake: no-op."""
        if self.elastic and self.pool.is_awake("kv_cache"):
            before = self.blocks.usable
            self.pool.grow("kv_cache")
            usable = self._mapped_blocks()
            if usable > before:
                self.runner.reset_kv_cache(before, usable)
                self.blocks.grow(usable)
                self.scheduler.blocks_short = False
        return self.kv_mapped_bytes

