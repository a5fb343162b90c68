"""Triton kernels of the rollout engine (CUDA; also run on CPU tensors under TRITON_INTERPRET=1).

paged_decode_attention: decode attention over the paged KV cache (see paged_decode.py).
paged_prefill_attention: prefill over the paged cache via varlen_attn on CUDA (see prefill.py).

Default launch settings for an H200, fixed (no autotuning: the first call of a shape compiles
once and a CUDA-graph capture never starts a tuning sweep). T = tokens per tile. Resources are
from compiling for sm_90 with Triton 3.6 (cuobjdump --dump-resource-usage), Qwen3 shapes:

| KV dtype  | head_dim | T  | warps | stages | regs | smem   | programs/SM | K+V in flight/SM |
|-----------|----------|----|-------|--------|------|--------|-------------|------------------|
| bf16/fp16 | <= 128   | 64 | 4     | 3      | 128  | 39 KiB | 4           | 4 x 32 KiB       |
| fp8 e4m3  | <= 128   | 64 | 4     | 3      | 114  | 39 KiB | 4           | 4 x 16 KiB       |
| any       | > 128    | 32 | 4     | 2      |      |        |             |                  |

Why: decode is memory-bound (16 FLOP per KV byte with a GQA group padded to 16 rows, against
the H200's ~200 FLOP/B ridge), so bytes in flight are what count: 4.8 TB/s over 132 SMs at ~1 us
latency is ~36 KiB per SM. With 3 stages the pipeliner prefetches the block-table entries one
tile ahead and K/V (16-byte cp.async) one tile ahead; 5 stages doubles the K/V buffers (72 KiB,
139 regs, 3 programs/SM). The split count comes from shapes: about two waves of programs over
the SMs, at most one split per tile. `handoff bench kernel --variants` times alternatives.
"""

from handoff.rollout.kernels.paged_decode import (choose_num_splits, default_config,
                                                  paged_decode_attention)
from handoff.rollout.kernels.prefill import paged_prefill_attention

__all__ = ["choose_num_splits", "default_config", "paged_decode_attention",
           "paged_prefill_attention"]
