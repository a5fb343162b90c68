"""torch.compile of the trainer's decoder layers (`actor.compile`): fused norms, RoPE, SwiGLU.

    set_compiled_layers(model, True)     # each decoder layer's forward through torch.compile
    set_compiled_layers(model, False)    # back to eager
    compiles_so_far()                    # graphs compiled in this process (a step's metric)

What it is for: in eager mode a Qwen3 layer runs each RMSNorm, the rotary embedding, SiLU x
up and the residual adds as separate kernels, each a full pass over the activations (and
more passes in backward); inductor fuses them, which is where most of a step's non-GEMM
kernel time goes (docs/PERF.md, "The trainer's compute").

The layer's `forward` is compiled, not its `__call__`: FSDP2's gather / reshard hooks and
transformers' activation checkpointing wrap `__call__` and stay eager around it. The
attention function itself is left out of the graph (trainer/attention.py disables compile for
it): FlashAttention varlen is one kernel already, and its backend probe must not be traced.
Shapes are dynamic from the first call (`dynamic=True`: the token dimension is symbolic, as
packed micro-batches and padded rows differ in length each step), so the one compiled code
is shared by every layer and micro-batch; the first micro-batch pays for the compile (~31 s
for a 4B layer on the H200, handoff.plan.compile), a step's first with grad and the
reference's first without. Later steps compile nothing unless a new kind of input appears
(a batch of one row, grad on or off): loop.py writes the graphs compiled during each step as
`actor/compiles`, so a recompile shows. The compiled graphs persist across processes in
handoff's cache (handoff.compile_cache, activated before the first compile).
"""

from __future__ import annotations

import torch

from handoff import compile_cache

BACKEND = "inductor"
_EAGER = "_handoff_eager_forward"     # the layer's own forward, kept while compiled


def _raise_recompile_limit(limit: int = 64) -> None:
    """Grad on/off, the reference and the actor, packed and padded layouts: more compiled
    variants than dynamo's default limit of 8 before it falls back to eager."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):   # the name changed in torch 2.7
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


def set_compiled_layers(model: torch.nn.Module, on: bool, *, backend: str | None = None) -> None:
    """Compile each decoder layer's forward with `backend` (BACKEND when None), or restore
    the eager one; idempotent."""
    if on:
        _raise_recompile_limit()
        compile_cache.activate()
    for layer in model.model.layers:
        compiled = _EAGER in layer.__dict__
        if on and not compiled:
            layer.__dict__[_EAGER] = layer.forward
            layer.forward = torch.compile(layer.forward, backend=backend or BACKEND,
                                          dynamic=True)
        elif not on and compiled:
            del layer.forward
            eager = layer.__dict__.pop(_EAGER)
            if getattr(eager, "__func__", None) is not type(layer).forward:
                layer.forward = eager     # an instance-level forward of someone else's


def layers_compiled(model: torch.nn.Module) -> bool:
    return any(_EAGER in layer.__dict__ for layer in model.model.layers)


def compiles_so_far() -> int:
    """Graphs dynamo compiled in this process: a first compile, a recompile for a new input
    shape or kind, and each piece of a graph split by a break count one each."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
