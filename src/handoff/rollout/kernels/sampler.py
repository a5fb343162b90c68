"""The sampled draw in one Triton kernel: two reads of a row's logits instead of ~12 passes.

    tokens_B, logprobs_B = fused_draw(logits_BV, temperature_B, uniform_B)

What `sampling.draw` computes without truncation, one program per row, in two reads of the
row and one of a block: the largest scaled logit x/T and its first index (each lane keeps its
own maximum; one reduction at the end); each 2048-token block's mass sum(exp(x/T - max)) in
float64, kept in a small [rows, blocks] buffer, and their total; then the first token whose
running mass exceeds uniform x total (inverse CDF in id order, as the torch path): the block
from the cumulated block masses, the token from that block's own running sum.
Rows with temperature 0 take the largest logit; the log-prob is x/T - max - log(total)
(temperature 1 for greedy rows), taken before any truncation, as the torch path's. The torch
path makes about twelve float32-sized passes over [rows, V] (the float copy, the
temperature, log_softmax, exp, a float64 CDF written and read, two argmaxes): ~1.9 GB at 256
rows of Qwen3's 151,936 tokens, ~0.45 ms at 4.2 TB/s; this reads the bf16 logits twice.
No library fuses an inverse-CDF draw keyed by our counter-based uniforms, hence the kernel.

The running mass is summed block by block, not by torch's cumsum, so a uniform that falls
within rounding of a CDF boundary can take the neighbouring token: the kernel's draws are
seeded, batch-independent and the same captured or eager, but not bit-equal to the torch
path's (the CPU's). HANDOFF_FUSED=0 keeps the torch path on CUDA too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _draw_kernel(logits_ptr, stride_row, temp_ptr, u_ptr, tok_ptr, lp_ptr, mass_ptr,
                 V: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_PAD: tl.constexpr):
    # V (the vocabulary) is a constant of the model: one compile per model, loops of fixed trips.
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    mass = mass_ptr + row.to(tl.int64) * BLOCKS_PAD   # this row's mass per block of logits
    one = tl.arange(0, 1)
    t = tl.load(temp_ptr + row + one)
    greedy = t == 0.0
    scale = tl.where(greedy, 1.0, t)
    offs = tl.arange(0, BLOCK)

    # 1: the largest scaled logit and the first index holding it. Each lane keeps its own
    # maximum (and the first index of it) over the blocks; one reduction at the end.
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_arg = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) / scale
        lane_arg = tl.where(x > lane_max, idx, lane_arg)
        lane_max = tl.maximum(lane_max, x)
    m = tl.max(lane_max, 0)
    arg = tl.min(tl.where(lane_max == m, lane_arg, V), 0)

    # 2: each block's mass exp(x - m), kept for the search, and the total (float64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) / scale
        tl.store(mass + start // BLOCK, tl.sum(tl.exp(x - m).to(tl.float64), 0))
    tl.debug_barrier()   # the block masses other threads stored, visible to every thread
    blocks = tl.arange(0, BLOCKS_PAD)
    block_mass = tl.load(mass + blocks, mask=blocks < tl.cdiv(V, BLOCK), other=0.0)
    total = tl.sum(block_mass, 0)

    # 3: the first token whose running mass exceeds uniform x total: the block first, then
    # the token inside it
    target = tl.load(u_ptr + row + one) * total
    through = tl.cumsum(block_mass, 0)                        # the mass up to each block's end
    before = through - block_mass                              # and before its start
    hit_block = (through > target) & (blocks < tl.cdiv(V, BLOCK))
    b = tl.min(tl.where(hit_block, blocks, BLOCKS_PAD), 0)
    found = tl.full([1], V, tl.int32)
    if b < BLOCKS_PAD:
        idx = b * BLOCK + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) / scale
        p = tl.exp(x - m).to(tl.float64)
        offset = tl.sum(tl.where(blocks == b, before, 0.0), 0)
        hit = ((offset + tl.cumsum(p, 0)) > target) & (idx < V)
        found = tl.minimum(found, tl.min(tl.where(hit, idx, V), 0))

    token = tl.where(found < V, found, V - 1)
    x_tok = tl.load(base + token).to(tl.float32) / scale
    # Rounding at the top of the CDF can land on a token of no mass: take the mode instead.
    token = tl.where(greedy | (tl.exp(x_tok - m) == 0.0), arg, token)
    x_tok = tl.load(base + token).to(tl.float32) / scale
    logprob = x_tok - m - tl.log(total).to(tl.float32)
    tl.store(tok_ptr + row + one, token.to(tl.int64))
    tl.store(lp_ptr + row + one, logprob)


def fused_draw(logits_BV: torch.Tensor, temperature_B: torch.Tensor,
               uniform_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [B], log-probs float32 [B]) drawn by inverse CDF (module docstring).

    logits_BV: bf16/fp16/fp32 with a contiguous last dim; temperature_B float32 (0: greedy);
    uniform_B float64 in [0, 1). One launch, nothing read back: it can be captured."""
    rows, vocab = logits_BV.shape
    assert logits_BV.stride(-1) == 1, "the vocabulary dim must be contiguous"
    device = logits_BV.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    blocks_pad = triton.next_power_of_2(triton.cdiv(vocab, _BLOCK))
    mass = torch.empty(rows, blocks_pad, dtype=torch.float64, device=device)
    if rows:
        _draw_kernel[(rows,)](logits_BV, logits_BV.stride(0), temperature_B.contiguous(),
                              uniform_B.contiguous(), tokens, logprobs, mass, vocab,
                              BLOCK=_BLOCK, BLOCKS_PAD=blocks_pad, num_warps=8)
    return tokens, logprobs
