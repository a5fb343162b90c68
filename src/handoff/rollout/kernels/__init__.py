"""Triton kernels of the rollout engine (CUDA; also run on CPU tensors under TRITON_INTERPRET=1).

paged_decode_attention: decode attention over the paged KV cache (see paged_decode.py).

Default launch settings for an H200 (no autotuning, so the first call of a shape compiles once
and a CUDA-graph capture never triggers a tuning sweep), per tile of T tokens:

| KV dtype   | head_dim | T (tokens/tile) | num_warps | num_stages | bytes in flight per program |
|------------|----------|-----------------|-----------|------------|-----------------------------|
| bf16/fp16  | <= 128   | 64              | 4         | 3          | 2 stages x 32 KiB (K + V)   |
| fp8 e4m3   | <= 128   | 128             | 4         | 3          | 2 stages x 32 KiB           |
| any        | > 128    | 32              | 4         | 2          | 1 stage x 32 KiB at d=256   |

Why: decode is memory-bound (about 16 FLOP per KV byte at GQA 8 padded to 16 rows, far below
the H200's ~200 FLOP/B ridge), so what counts is bytes in flight: ~4.8 TB/s x ~1 us latency is
about 36 KiB per SM, which two resident programs of 32 KiB stages cover with room to spare in
228 KiB of shared memory. Four warps suffice for a [16, 64] x [64, 128] product. The split
count comes from shapes: about two waves of programs over the SMs, at least two tiles per split.
"""

from handoff.rollout.kernels.paged_decode import (choose_num_splits, default_config,
                                                  paged_decode_attention)

__all__ = ["choose_num_splits", "default_config", "paged_decode_attention"]
