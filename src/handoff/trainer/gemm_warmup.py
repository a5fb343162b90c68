"""Launch a model's GEMM shapes once, before copies run beside its forward.

    launched = warm_gemms(module, [(1, 9000), (1, 15000)], chunk_tokens=4096, device=dev)

Why: the first launch of a cuBLAS kernel in a process waits for the device to go idle, copies
on other streams included, and which kernel a GEMM gets depends on its row count. A packed
micro-batch's token count can be new in any step, and a forward with the copies back queued
beside it then stalls until they have landed (docs/PERF.md: a new row count waits out a 16 GB
H2D; the 4B ref's forward took 2.80 s in a step with a new shape, 2.30 s in the others).
Launched here first, before the copies are queued, each new shape's kernel loads with
nothing beside it, and the forward finds it loaded. No library keeps cuBLAS from loading lazily (CUDA_MODULE_LOADING=EAGER was
measured: the stall stays), so this is ours.

The GEMMs are the model's: every nn.Linear shape at the micro-batch's rows (the input's
[b, w], as the model calls it) and the log-prob head's chunks (train.logprobs: `h @ W.t()`
at each chunk's row count), with dummy operands of the same shapes and dtypes. `backward`
adds each Linear's two backward GEMMs (autograd's, as in the update); the head's backward
is not warmed (its fp32 weight grad would need the vocabulary's [V, H] twice over).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

# (kind, shape..., dtype, backward) launched in this process: a loaded kernel stays loaded.
_launched: set[tuple] = set()


def model_gemms(module: torch.nn.Module, row_shapes: Iterable[tuple[int, int]], *,
                chunk_tokens: int, backward: bool = False) -> list[tuple]:
    """The GEMMs a forward of `module` runs over inputs of each [b, w] in `row_shapes`."""
    head = module.get_output_embeddings()
    linears = sorted({(m.out_features, m.in_features, m.weight.dtype)
                      for m in module.modules()
                      if isinstance(m, torch.nn.Linear) and m is not head},
                     key=str)
    vocab, hidden, head_dtype = head.out_features, head.in_features, head.weight.dtype
    gemms: list[tuple] = []
    for b, w in dict.fromkeys(row_shapes):
        gemms += [("linear", b, w, out, inp, dtype, backward) for out, inp, dtype in linears]
        if chunk_tokens > 0:
            n = b * w
            gemms += [("head", rows, vocab, hidden, head_dtype)
                      for rows in sorted({min(chunk_tokens, n), n % chunk_tokens} - {0})]
        else:
            gemms.append(("linear", b, w, vocab, hidden, head_dtype, backward))
    return gemms


def warm_gemms(module: torch.nn.Module, row_shapes: Iterable[tuple[int, int]], *,
               chunk_tokens: int, device: torch.device, backward: bool = False) -> int:
    """Launch each of the forward's GEMMs (model_gemms) not launched before in this process,
    on dummy operands; returns how many were launched. Not waited for."""
    todo = [g for g in model_gemms(module, row_shapes, chunk_tokens=chunk_tokens,
                                   backward=backward) if g not in _launched]
    weights: dict[tuple, torch.Tensor] = {}

    def weight(out: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
        key = (out, inp, dtype)
        if key not in weights:
            weights[key] = torch.empty(out, inp, dtype=dtype, device=device)
        return weights[key]

    for gemm in todo:
        if gemm[0] == "head":
            _, rows, vocab, hidden, dtype = gemm
            with torch.no_grad():
                torch.empty(rows, hidden, dtype=dtype, device=device) @ weight(
                    vocab, hidden, dtype).t()
        else:
            _, b, w, out, inp, dtype, grad = gemm
            with torch.enable_grad() if grad else torch.no_grad():
                x = torch.empty(b, w, inp, dtype=dtype, device=device, requires_grad=grad)
                y = F.linear(x, weight(out, inp, dtype).requires_grad_(grad))
                if grad:
                    y.backward(torch.empty_like(y))
        _launched.add(gemm)
    return len(todo)
