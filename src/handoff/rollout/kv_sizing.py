"""How many KV blocks the engine's pool gets: the one sizing rule, which the engine applies
at start and the run's calibration applies beforehand (to time a region of that size).

    num_blocks = kv_pool_blocks(cfg.rollout, block_bytes=..., on_cuda=True,
                                hbm_bytes=total, weights_bytes=w, overhead_bytes=peak + graphs)

* rollout.num_blocks set: exactly that many.
* CUDA: util x HBM - the engine's weights - its activation peak and decode graphs (the
  source's ledger: memory other owners hold is not charged to the engine). An elastic pool
  (rollout.kv_pool=elastic) reserves the largest the card could hold: util 1, mapped at each
  wake as far as memory is free.
* CPU: room for max_num_seqs sequences of max_model_len, capped at CPU_DEFAULT_KV_BYTES, and
  never less than one sequence.
"""

from __future__ import annotations

CPU_DEFAULT_KV_BYTES = 256 << 20


def blocks_for_one_sequence(max_model_len: int, block_size: int) -> int:
    """Blocks one sequence of max_model_len needs, plus the null block: a pool's minimum (the
    scheduler's progress guarantee)."""
    return -(-max_model_len // block_size) + 1


def kv_pool_budget_bytes(utilization: float, *, hbm_bytes: int, weights_bytes: int,
                         overhead_bytes: int) -> int:
    """CUDA: util x HBM less the engine's weights and its activation peak + graph pool."""
    return int(utilization * hbm_bytes) - weights_bytes - overhead_bytes


def kv_pool_blocks(cfg, *, block_bytes: int, on_cuda: bool, max_model_len: int,
                   hbm_bytes: int = 0, weights_bytes: int = 0, overhead_bytes: int = 0,
                   elastic: bool = False) -> int:
    """The pool's block count for RolloutConfig `cfg` (see the module docstring); may be
    below blocks_for_one_sequence, which the engine refuses with the numbers."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if on_cuda:
        utilization = 1.0 if elastic else cfg.gpu_memory_utilization
        budget = kv_pool_budget_bytes(utilization, hbm_bytes=hbm_bytes,
                                      weights_bytes=weights_bytes, overhead_bytes=overhead_bytes)
        return max(budget, 0) // block_bytes
    needed = blocks_for_one_sequence(max_model_len, cfg.block_size)
    wanted = cfg.max_num_seqs * (needed - 1) + 1
    return max(needed, min(wanted, CPU_DEFAULT_KV_BYTES // block_bytes))
