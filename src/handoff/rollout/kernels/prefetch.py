"""Pull a tensor's bytes into the L2 cache ahead of the kernel that reads them.

    l2_prefetch(weight_NK, max_bytes=16 << 20)

A decode step at small batch leaves HBM idle between its products: attention, the norms and
each launch's ramp move few bytes, and a product of a few MB (o_proj's 8 MB on the 1.7B)
spends much of its time starting up rather than streaming. Launched on a side stream beside
those kernels, this asks each SM's TMA unit (`cp.async.bulk.prefetch.L2`, Hopper's bulk
prefetch: no registers, no shared memory, nothing written) for the next product's weight,
so the product finds it in L2 (50 MB on an H100/H200). The bytes read are the same; they
move while HBM would otherwise wait.

Triton 3.6 has no bulk L2 prefetch of its own (CUTLASS's TMA prefetch lives inside its own
kernels), hence the inline PTX. Hopper and newer (sm_90+: pdl.hopper).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from handoff.errors import HandoffError

CHUNK = 16384          # bytes one thread asks for (a multiple of 16; the PTX's size operand)
_PER_PROGRAM = 128     # threads with a chunk each: 2 MiB a program


@triton.jit
def _prefetch_kernel(base_ptr, n_chunks, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    idx = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    addr = base_ptr + idx.to(tl.int64) * CHUNK
    live = (idx < n_chunks).to(tl.int32)
    # Not pure: nothing reads the result, and the prefetch must not be dropped as dead code.
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
        f"@p cp.async.bulk.prefetch.L2.global [$1], {CHUNK}; mov.u32 $0, 0; }}",
        "=r,l,r", [addr, live], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, max_bytes: int | None = None) -> None:
    """Ask for the first `max_bytes` (all by default) of contiguous `t` in L2, on the current
    stream. Whole chunks only: a tail under CHUNK bytes is left to the reader."""
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise HandoffError(f"l2_prefetch: a {tuple(t.shape)} tensor with strides {t.stride()} "
                           "at a misaligned address: pass a contiguous, 16-byte aligned tensor")
    n_bytes = t.numel() * t.element_size()
    if max_bytes is not None:
        n_bytes = min(n_bytes, max_bytes)
    n_chunks = n_bytes // CHUNK
    if n_chunks == 0:
        return
    grid = (triton.cdiv(n_chunks, _PER_PROGRAM),)
    _prefetch_kernel[grid](t.view(torch.uint8), n_chunks, CHUNK=CHUNK, PER_PROGRAM=_PER_PROGRAM)


MB = 1 << 20


def parse_plan(text: str) -> dict:
    """A prefetch plan from its name: '+'-joined parts, asked for once a layer's qkv product
    is launched. o: o_proj's weight; gu<MB>: the first MB of gate_up's; qkv<MB>: the next
    layer's qkv weight. 'o+gu16' -> {'o': True, 'gu': 16 MiB, 'qkv': 0}."""
    plan = {"o": False, "gu": 0, "qkv": 0}
    for part in filter(None, text.split("+")):
        if part == "o":
            plan["o"] = True
        elif part[:2] == "gu" and part[2:].isdigit():
            plan["gu"] = int(part[2:]) * MB
        elif part[:3] == "qkv" and part[3:].isdigit():
            plan["qkv"] = int(part[3:]) * MB
        else:
            raise HandoffError(f"prefetch plan part {part!r} (HANDOFF_L2_PREFETCH): use o, "
                               "gu<MB> or qkv<MB>, joined by '+', e.g. o+gu16")
    return plan


class LayerPrefetch:
    """A side stream that asks for each decoder layer's next weights once its qkv product is
    launched, while its RoPE, attention and norms run; the layer joins it before it ends (a
    captured graph must join every stream it forks). `weights`: each layer's (o_proj,
    gate_up_proj, qkv_proj) weights, in order."""

    def __init__(self, weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 plan: dict, stream: "torch.cuda.Stream | None"):
        self.stream = stream
        self._asks: list[list[tuple[torch.Tensor, int | None]]] = []
        for i, (o, gate_up, _) in enumerate(weights):
            asks = []
            if plan["o"]:
                asks.append((o, None))
            if plan["gu"]:
                asks.append((gate_up, plan["gu"]))
            if plan["qkv"] and i + 1 < len(weights):
                asks.append((weights[i + 1][2], plan["qkv"]))
            self._asks.append(asks)
        self._forked = False

    def after_qkv(self, layer: int) -> None:
        asks = self._asks[layer]
        if not asks:
            return
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        self._forked = True
        with torch.cuda.stream(self.stream):
            for tensor, max_bytes in asks:
                l2_prefetch(tensor, max_bytes)

    def join(self) -> None:
        if self._forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._forked = False
