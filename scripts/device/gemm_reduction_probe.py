"""Does cuBLAS's split-K reduce cost the decode GEMMs their bandwidth? (issue 32: at batch <=
128 the profile shows a reduce kernel after most products.) Each Qwen3-1.7B decode linear at
1, 32 and 128 rows, the weight from HBM (do_bench flushes L2), as GB/s of its weight bytes:
cuBLAS and cuBLASLt, with bf16 reduced-precision reductions allowed (PyTorch's default) and
not.
    python3 scripts/device/gemm_reduction_probe.py
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048),
          "down": (2048, 6144), "lm_head": (151936, 2048)}


def main() -> None:
    matmul = torch.backends.cuda.matmul
    print("| linear | rows | cublas | cublas, no reduced reduce | cublaslt | cublaslt, no reduced "
          "reduce |  GB/s\n|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda").bfloat16()
        for m in (1, 32, 128):
            x = torch.randn(m, k, device="cuda").bfloat16()
            cells = []
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                for reduced in (True, False):
                    matmul.allow_bf16_reduced_precision_reduction = reduced
                    ms = do_bench(lambda: F.linear(x, w), warmup=10, rep=50)
                    cells.append(f"{w.numel() * 2 / ms / 1e6:.0f}")
            matmul.allow_bf16_reduced_precision_reduction = True
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"| {name} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
