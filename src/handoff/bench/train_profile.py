"""Where a trainer step's time goes: torch.profiler events summed into a few categories.

    with torch.profiler.profile(activities=profiler_activities(device)) as prof:
        with mark_recompute(actor.module):
            one_step()
    summary = summarize(prof, device)   # {"categories": {...: seconds}, "launches": n, ...}

On CUDA each kernel (and memcpy / memset) is attributed to the CPU op that launched it, and
that op's chain of parents decides the category (a copy between host and card is
`host_copies`, whatever launched it: it runs on the copy engines beside the compute), in this
order: the optimizer step's range,
attention ops, matmuls (GEMM), the log-prob head (its range, or softmax / logsumexp ops),
copies (copy_, cat, index, gather, scatter, fill), other aten ops (elementwise, norms,
reductions), the rest. On CPU the same rules sum each op's own CPU time. Kernels under
`handoff.recompute` (a layer's attention and MLP run again inside backward by activation
checkpointing) are also summed on their own, as a part of the categories above. The
TOP_KERNELS kernels (ops on CPU) of each category that took the most time are listed by name.
"""

from __future__ import annotations

import re
import types
from contextlib import contextmanager
from typing import Iterator

import torch

from handoff.trainer.logprobs import HEAD_RANGE

OPTIMIZER_RANGE = "handoff.optimizer_step"
RECOMPUTE_RANGE = "handoff.recompute"
CATEGORIES = ("gemm", "attention", "logprob_head", "elementwise_norm", "copies", "optimizer",
              "other", "host_copies")
# Copies between host and card (the offloads around the parts): copy engines, not compute.
_HOST_COPY = re.compile(r"^Memcpy (HtoD|DtoH)")
TOP_KERNELS = 6
_RULES = (
    ("optimizer", re.compile(re.escape(OPTIMIZER_RANGE))),
    ("attention", re.compile(r"flash|fmha|attention|varlen|sdpa", re.I)),
    ("gemm", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm)$|gemm|cublas|nvjet|cutlass",
                        re.I)),
    ("logprob_head", re.compile(re.escape(HEAD_RANGE) + r"|softmax|logsumexp|ChunkedTokenLogProbs",
                                re.I)),
    ("copies", re.compile(r"copy|^aten::(cat|index|index_put_?|gather|scatter\w*|fill_|zero_|"
                          r"clone|contiguous)$|memcpy|memset", re.I)),
    ("elementwise_norm", re.compile(r"^aten::")),
)


def profiler_activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _chain(evt) -> list[str]:
    names = []
    while evt is not None:
        names.append(evt.name)
        evt = evt.cpu_parent
    return names


def category(names: list[str]) -> str:
    for cat, pattern in _RULES:
        if any(pattern.search(n) for n in names):
            return cat
    return "other"


def summarize(prof, device: torch.device) -> dict:
    """Seconds per category (total_seconds leaves host_copies out), seconds under recompute,
    the launch (or op) count, and each category's top kernels: {category: [[name, s], ...]}."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[tuple[str, str], float] = {}
    recompute = 0.0
    launches = 0
    cuda = device.type == "cuda"
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        if cuda:
            spans = [(k.name, k.duration / 1e6) for k in getattr(evt, "kernels", [])]
        elif evt.name.startswith("aten::") and not evt.is_user_annotation:
            spans = [(evt.name, evt.self_cpu_time_total / 1e6)]
        else:
            spans = []
        if not spans:
            continue
        launches += len(spans)
        names = _chain(evt)
        launched_by = category(names)
        for name, spent in spans:
            cat = "host_copies" if _HOST_COPY.search(name) else launched_by
            seconds[cat] += spent
            by_name[cat, name] = by_name.get((cat, name), 0.0) + spent
            if RECOMPUTE_RANGE in names and cat != "host_copies":
                recompute += spent
    top: dict[str, list] = {c: [] for c in CATEGORIES}
    for (cat, name), spent in sorted(by_name.items(), key=lambda x: -x[1]):
        if len(top[cat]) < TOP_KERNELS:
            top[cat].append([name, spent])
    total = sum(s for c, s in seconds.items() if c != "host_copies")
    return {"categories": seconds, "total_seconds": total, "recompute_seconds": recompute,
            "launches": launches, "top_kernels": top,
            "unit": "kernel time" if cuda else "CPU op self time"}


@contextmanager
def mark_recompute(model: torch.nn.Module) -> Iterator[None]:
    """While on, each decoder layer's attention and MLP, when run inside backward (the
    checkpoint's recompute), run under the RECOMPUTE_RANGE profiler range."""
    patched = []
    for layer in model.model.layers:
        for name in ("self_attn", "mlp"):
            sub = getattr(layer, name, None)
            if sub is None:
                continue
            inner = sub.forward

            def forward(self, *args, _inner=inner, **kwargs):
                if torch._C._current_graph_task_id() == -1:
                    return _inner(*args, **kwargs)
                with torch.profiler.record_function(RECOMPUTE_RANGE):
                    return _inner(*args, **kwargs)

            sub.forward = types.MethodType(forward, sub)
            patched.append((sub, inner))
    try:
        yield
    finally:
        for sub, inner in patched:
            if getattr(inner, "__self__", None) is sub and inner.__func__ is type(sub).forward:
                del sub.forward
            else:
                sub.forward = inner
