"""Where the skinny product's time goes (device, one minute): each Qwen3-1.7B decode linear at
1, 4, 16 and 32 rows, the weight from HBM (do_bench's L2 flush), as GB/s of its weight bytes:
cuBLAS, the skinny kernel autotuned and under each config (SPLIT_K among them: the best
config's split says whether splitting K pays), and the same product with the
operands swapped (y^T = W x^T: the weight is the dot's left operand, BLOCK_N rows wide, so
Hopper's wgmma serves it where BLOCK_N >= 64), to see whether the loop or the layout is slow.
    python3 scripts/device/skinny_probe.py
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from handoff.rollout.kernels.skinny import CONFIGS, _fitting, skinny_linear


@triton.jit
def _swapped(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
             M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + ks[None, :],
                    mask=(rows < N)[:, None] & (ks < K)[None, :], other=0.0)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + ks[:, None],
                     mask=(offs_m < M)[None, :] & (ks < K)[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + rows[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[None, :] & (rows < N)[:, None])


def swapped(x, w, block_n, block_k, warps, stages):
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    m_pad = max(16, triton.next_power_of_2(x.shape[0]))
    _swapped[(triton.cdiv(w.shape[0], block_n),)](
        x, w, y, x.shape[0], w.shape[0], w.shape[1], x.stride(0), w.stride(0), y.stride(0),
        M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def gbps(fn, nbytes):
    return nbytes / (do_bench(fn, warmup=5, rep=30) * 1e-3) / 1e9


def main():
    shapes = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048),
              "down": (2048, 6144)}
    swaps = [(n, k, w, s) for n, k, w, s in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3),
                                             (128, 64, 4, 4), (32, 256, 4, 4), (64, 128, 4, 6))]
    print("| linear | rows | cuBLAS GB/s | skinny tuned | skinny best config | swapped best |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda").bfloat16()
        for m in (1, 4, 16, 32):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = x.float() @ w.float().T
            nbytes = w.numel() * 2
            cublas = gbps(lambda: F.linear(x, w), nbytes)
            tuned = gbps(lambda: skinny_linear(x, w), nbytes)
            best = max((gbps(lambda c=c: skinny_linear(x, w, config={**c.kwargs,
                        "num_warps": c.num_warps, "num_stages": c.num_stages}), nbytes),
                         str(c.kwargs) + f" w{c.num_warps} s{c.num_stages}")
                       for c in _fitting(CONFIGS, {"N": n, "K": k}, M_PAD=16, GATED=False,
                                         HAS_RESIDUAL=False))
            rows = []
            for cfg in swaps:
                try:
                    err = (swapped(x, w, *cfg).float() - ref).abs().max().item()
                    rows.append((gbps(lambda cfg=cfg: swapped(x, w, *cfg), nbytes), cfg, err))
                except Exception as exc:   # a config past shared memory: say so, go on
                    print(f"swapped {cfg}: {type(exc).__name__}")
            sw = max(rows) if rows else (0.0, None, 0.0)
            print(f"| {name} {n}x{k} | {m} | {cublas:.0f} | {tuned:.0f} | {best[0]:.0f} "
                  f"({best[1]}) | {sw[0]:.0f} {sw[1]} err {sw[2]:.3f} |")


if __name__ == "__main__":
    main()
