"""LoRA adapters applied by the engine itself, beside the base weights (never merged into them).

    engine = Engine("ckpt/", cfg.rollout, lora_max_rank=16)
    engine.load_adapter(load_file("adapter/adapter_model.safetensors"), alpha=32, rank=16)
    engine.clear_adapter()                                     # zeros: the base's outputs

Each targeted projection computes y = x W^T + (alpha / r) (x A^T) B^T, the scale folded into
A when it is copied in (exact for the usual alpha / r, a power of two). Merging the adapter
into a bf16 base and unmerging it again each step would drift the base by rounding, so the
base is never written: every engine linear gets a `LoraSlot` holding fixed, zero-padded
buffers sized for a maximum rank, and a new adapter is copied into them in place (the decode
graphs capture their addresses, so a sync only rewrites their values).

The engine fuses q/k/v and gate/up (models/qwen3.py): a fused linear's slot stacks one A per
part, A [P*R, in], and keeps B block-diagonal, B [out, P*R] (part p's rows of the fused output
read only columns p*R..p*R+r), so one pair of GEMMs serves all parts. Under TP a column-
parallel linear keeps its rows of B and all of A; a row-parallel one (o_proj, down_proj) keeps
its input columns of A and all of B, and adds its partial delta before the all-reduce.

With `lora_max_rank` the engine builds each decoder linear with its A rows right after its
weight rows in the weights' buffer (models.build_model), and one GEMM gives x W^T and x A^T
side by side (at decode batch a launch costs about what these small products do). Not where
the GEMM adds a bias, or for a row-parallel linear under TP (its output is the all-reduce's
dense buffer): there A is a buffer of its own and the shrink a GEMM of its own. The expand
t B^T: in a forward of few rows (a decode step) the fused kernel that reads q/k/v's or
gate/up's product adds it (ops.PendingTerm: the rope, the SiLU), no launch of its own; o's
and down's a small Triton kernel adds in place (kernels/fused.add_term); a longer forward's
(a prefill) a GEMM. The zero buffers exist from the start, so the decode graphs capture
them (and the adapter's products run even while they are zero). A sleep of level 1 keeps
the adapter (A is backed up with the weights, B lives outside the regions: megabytes);
level 2 drops it with the weights.

Without `lora_max_rank` the engine has no slot until its first load_adapter (then sized for
that adapter's rank, A apart; refused once decode graphs were captured without them): until
then its linears test one attribute and do nothing else.

Shape legend: T = tokens, E = in features, F = out features (this rank's), P = fused parts,
R = maximum rank.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

import torch
import torch.nn.functional as F

from handoff.errors import HandoffError
from handoff.rollout import ops
from handoff.rollout.layers import ColumnParallelLinear, ShardRule, shard_rules
from handoff.rollout.models.qwen3 import FUSED, CausalLM
from handoff.rollout.weight_copy import copy_in_batches

# PEFT's names as save_pretrained writes them, with or without the `base_model.model.` prefix
# (a live PeftModel's parameters also carry the adapter name, `default`).
_PEFT_NAME = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                        r"(\w+)\.lora_([AB])(?:\.default)?\.weight")
_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "mlp": ("gate_proj", "up_proj", "down_proj")}


class LoraSlot:
    """One engine linear's adapter buffers: A [P*R, E] (scaled by alpha / r), B [F, P*R]
    block-diagonal. Where the linear kept rows for A after its weight (build_model's
    lora_max_rank), A is those rows and `joined` [F + P*R, E] the weight with them."""

    def __init__(self, weight: torch.Tensor, max_rank: int, joined: torch.Tensor | None = None):
        num_parts = len(shard_rules(weight))
        out_features, in_features = weight.shape
        kw = {"device": weight.device, "dtype": weight.dtype}
        if joined is not None and joined.shape[0] == out_features + num_parts * max_rank:
            self.joined = joined
            self.A = joined[out_features:].zero_()
        else:
            self.joined = None
            self.A = torch.zeros(num_parts * max_rank, in_features, **kw)
        self.B = torch.zeros(out_features, num_parts * max_rank, **kw)
        self.rank = max_rank   # columns of B per part

    def product(self, x_TE: torch.Tensor, weight_FE: torch.Tensor,
                bias_F: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x W^T + b, x A^T). With A joined to the weight, one GEMM gives both side by side
        (views of rows F + P*R apart); else two."""
        if self.joined is None:
            return F.linear(x_TE, weight_FE, bias_F), F.linear(x_TE, self.A)
        out = F.linear(x_TE, self.joined)
        width = weight_FE.shape[0]
        return out[..., :width], out[..., width:]

    def linear(self, x_TE: torch.Tensor, weight_FE: torch.Tensor,
               bias_F: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b + (x A^T) B^T: the product, then the expand (expand_into). A decode
        step's q/k/v and gate/up leave the expand to the fused kernel that reads them instead
        (ops.PendingTerm): at decode batch a launch costs about what these small products
        do. (Leaving o's and down's to the next norm was slower on an H100, one program a
        row or the row normed by its last column block; docs/log/2026-12-07-1 and -3.)"""
        return self.expand_into(*self.product(x_TE, weight_FE, bias_F))

    def expand_into(self, y_TF: torch.Tensor, t_TR: torch.Tensor) -> torch.Tensor:
        """y += t B^T in place, t = x A^T already computed (the skinny kernel's extra rows).
        A decode step's rows on the fused path: the Triton kernel (kernels/fused.add_term,
        cheaper than cuBLAS's GEMM at this inner size); else cuBLAS's GEMM, which adds in
        its epilogue."""
        if ops.term_in_triton(y_TF) and y_TF.stride(-1) == 1 and t_TR.stride(-1) == 1:
            from handoff.rollout.kernels.fused import add_term

            return add_term(y_TF, t_TR, self.B)
        return y_TF.addmm_(t_TR, self.B.t())


class LoraAdapters:
    """Every decoder linear's slot, and the copy of a PEFT adapter into them."""

    def __init__(self, model: CausalLM, max_rank: int):
        if max_rank < 1:
            raise HandoffError(f"LoRA max rank {max_rank} is not positive: use the adapter's r")
        self.max_rank = max_rank
        self.num_layers = len(model.model.layers)
        # (rank, the PEFT tensors written) of the adapter in the buffers; None: all zeros or
        # unknown. A load of the same layout overwrites exactly what the last one wrote.
        self._layout = None
        self._plan: _LoadPlan | None = None   # the last load's destinations (_LoadPlan)
        self.linears: dict[str, torch.nn.Module] = {}
        for name, module in model.named_modules():
            if hasattr(module, "lora") and name.startswith("model.layers."):
                self.linears[name] = module
                module.lora = LoraSlot(module.weight, max_rank,
                                       getattr(module, "weight_and_adapter", None))
        # A rows in the weights' buffer sleep with the weights (EngineLora checks it)
        self.beside_weights = any(m.lora.joined is not None for m in self.linears.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every slot's A and B (a decode step reads them all)."""
        return sum(t.numel() * t.element_size() for m in self.linears.values()
                   for t in (m.lora.A, m.lora.B))

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, alpha: float,
             rank: int) -> None:
        """Copy a PEFT adapter in place; every check runs before the first write."""
        if not 1 <= rank <= self.max_rank:
            raise HandoffError(f"LoRA rank {rank} is outside 1..{self.max_rank}, the rank the "
                               "engine's adapter buffers were sized for: build the Engine with "
                               f"lora_max_rank={max(rank, 1)}")
        names, tensors = [], []
        for name, tensor in named_tensors:
            names.append(name)
            tensors.append(tensor)
        plan = self._plan
        if plan is None or not plan.fits(rank, names, tensors):
            plan = self._plan = _LoadPlan.of(self, names, tensors, rank)
        # The training loop syncs the same layout every step: then every view written is
        # overwritten and the rest is still zero, so the buffers are not zeroed first.
        if plan.layout != self._layout:
            self.clear()
        plan.write(tensors, [linear.lora.A for linear in self.linears.values()], alpha / rank)
        self._layout = plan.layout

    def clear(self) -> None:
        """Zero every buffer: the adapter adds nothing."""
        buffers = [b for linear in self.linears.values() for b in (linear.lora.A, linear.lora.B)]
        torch._foreach_zero_(buffers)
        self._layout = None

    def detach(self) -> None:
        """Take every slot off its linear: the engine runs no adapter code again."""
        for linear in self.linears.values():
            linear.lora = None

    def _destination(self, name: str, tensor: torch.Tensor, rank: int
                     ) -> tuple[torch.Tensor, ShardRule | None, tuple[str, str]]:
        """(buffer view, the rule that takes this rank's part of `tensor` (None: all of it),
        (HF module, A or B)) of one PEFT tensor."""
        match = _PEFT_NAME.fullmatch(name)
        if (match is None or int(match[1]) >= self.num_layers
                or match[3] not in _PROJECTIONS[match[2]]):
            raise HandoffError(f"adapter tensor {name!r} is not a LoRA weight of a decoder "
                               f"projection the engine runs ({self.num_layers} layers; q/k/v/o, "
                               "gate/up/down): target only those modules, without bias or DoRA")
        layer, group, proj, which = int(match[1]), match[2], match[3], match[4]
        fused_name, part = FUSED.get(proj, (proj, 0))
        linear = self.linears[f"model.layers.{layer}.{group}.{fused_name}"]
        rule = shard_rules(linear.weight)[part]
        lo = part * self.max_rank
        column = isinstance(linear, ColumnParallelLinear)  # rows of B split, else columns of A
        in_full = linear.weight.shape[1] if column else rule.full_size
        out_full = rule.full_size if column else linear.weight.shape[0]
        expected = (rank, in_full) if which == "A" else (out_full, rank)
        if tuple(tensor.shape) != expected:
            raise HandoffError(f"adapter tensor {name!r} has shape {tuple(tensor.shape)}, the "
                               f"engine expects {expected} for rank {rank}: pass the rank the "
                               "adapter was trained with, for this model")
        key = (f"model.layers.{layer}.{group}.{proj}", which)
        if which == "A":
            return linear.lora.A[lo:lo + rank], None if column else rule, key
        if column:
            rows = linear.lora.B[rule.dest_start:rule.dest_start + rule.length]
            return rows[:, lo:lo + rank], rule, key
        return linear.lora.B[:, lo:lo + rank], None, key


class _LoadPlan:
    """Where each tensor of one adapter layout goes: worked out and checked once, then reused
    while a load passes the same names, shapes and rank: a training loop's every sync (each
    name matched to its buffer and checked is Python work a tensor, 560 on the 14B).

    The writes are two batched calls, the copies and A's scale, but `_foreach_copy_` takes
    its one-kernel path only where every pair shares sizes and strides, and a B block's row
    stride (the fused parts side by side) is not its source's: a launch per tensor. The
    32B's sync (896 tensors) took 10-16 ms of the device's host (H200, 2026-12-07). So on
    CUDA, once the same sources come twice (a training loop's adapters stay put), the writes
    are captured in a CUDA graph and replayed: one launch. The 1.7B's writes took 1.3 ms
    replayed against 3.9 launched (H100, 2026-12-07, scripts/device/14-sync-graph.sh).
    HANDOFF_SYNC_GRAPH=0 launches them every time."""

    def __init__(self, rank: int, names: list[str], signatures: list[tuple],
                 dests: list[torch.Tensor], rules: list[ShardRule | None], layout: tuple):
        self.rank, self.names, self.signatures = rank, names, signatures
        self.dests, self.rules, self.layout = dests, rules, layout
        self.nbytes = [d.numel() * d.element_size() for d in dests]
        self.graph = None            # the captured writes, and the sources they read
        self._graph_key = self._last_key = None
        # A copy from the host (an adapter file's tensors) cannot be captured.
        self.capturable = all(sig[3] == dest.device for sig, dest in zip(signatures, dests))

    @classmethod
    def of(cls, adapters: LoraAdapters, names: list[str], tensors: list[torch.Tensor],
           rank: int) -> _LoadPlan:
        """Every tensor's destination, checked (one line on the first bad one, before any
        write)."""
        dests, rules, halves = [], [], set()
        for name, tensor in zip(names, tensors):
            dest, rule, key = adapters._destination(name, tensor, rank)
            dests.append(dest)
            rules.append(rule)
            halves.add(key)
        unpaired = sorted(f"{module}.lora_{'B' if ab == 'A' else 'A'}" for module, ab in halves
                          if (module, "B" if ab == "A" else "A") not in halves)
        if unpaired:
            raise HandoffError(f"the adapter lacks {unpaired[0]} ({len(unpaired)} missing): "
                               "pass every lora_A and lora_B tensor that save_pretrained wrote")
        return cls(rank, list(names), [_signature(t) for t in tensors], dests, rules,
                   (rank, frozenset(halves)))

    def fits(self, rank: int, names: list[str], tensors: list[torch.Tensor]) -> bool:
        """The same names and rank, each tensor of the same shape, strides, dtype, device."""
        return (rank == self.rank and names == self.names
                and all(_signature(t) == sig for t, sig in zip(tensors, self.signatures)))

    def write(self, tensors: list[torch.Tensor], a_buffers: list[torch.Tensor],
              scale: float) -> None:
        """Copy each tensor's part into its destination, then scale every A by `scale`."""
        def write() -> None:
            copy_in_batches(self.copies(tensors))
            torch._foreach_mul_(a_buffers, scale)

        if not (self.capturable and _sync_graphs(self.dests)):
            write()
            return
        # The whole tensors' addresses: each part's follows from its tensor's (fits: the same
        # shapes and strides), so a replay builds no views.
        key = (scale, [t.data_ptr() for t in tensors])
        if self.graph is not None and key == self._graph_key:
            self.graph.replay()   # the sources sit where the graph reads them (key)
        elif key == self._last_key:
            self.graph, self._graph_key = capture_graph(write), key
            self.graph.replay()
        else:
            write()
        self._last_key = key

    def copies(self, tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(destination, this rank's part of the tensor, bytes) per tensor."""
        return [(dest, tensor if rule is None else rule.src(tensor), nbytes)
                for dest, tensor, rule, nbytes in zip(self.dests, tensors, self.rules,
                                                      self.nbytes)]


def _signature(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device


def _sync_graphs(dests: list[torch.Tensor]) -> bool:
    return bool(dests) and dests[0].is_cuda and os.environ.get("HANDOFF_SYNC_GRAPH") != "0"


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """`fn`'s launches captured (not run) in a CUDA graph; it allocates nothing."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return graph


class EngineLora:
    """The Engine's LoRA API (mixed into `Engine`, which owns `model`, `runner`, `lora` and the
    weights version that load_weights keeps)."""

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict, *,
                     alpha: float, rank: int) -> None:
        """Copy a PEFT adapter (its names, with or without `base_model.model.`) in place;
        a bad tensor is refused in one line before anything is written."""
        if isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        self._check_adapter_awake("load_adapter")
        if self.lora is None:
            if self.runner.graphs is not None:
                raise HandoffError("the decode graphs were captured without the adapter path: "
                                   f"build the Engine with lora_max_rank={rank} (or more)")
            self.lora = LoraAdapters(self.model, max_rank=rank)
            try:
                self.lora.load(named_tensors, alpha=alpha, rank=rank)
            except HandoffError:  # a first adapter refused: back to the engine without one
                self.lora.detach()
                self.lora = None
                raise
        else:
            self.lora.load(named_tensors, alpha=alpha, rank=rank)
        self._adapter_changed()

    def clear_adapter(self) -> None:
        """Zero the adapter: outputs equal the base model's (buffers and addresses kept)."""
        if self.lora is not None:
            self._check_adapter_awake("clear_adapter")
            self.lora.clear()
            self._adapter_changed()

    def _check_adapter_awake(self, call: str) -> None:
        """A rows kept beside the weights sleep with them: no write while they sleep."""
        if (self.lora is not None and self.lora.beside_weights
                and not self.pool.is_awake("weights")):
            raise HandoffError(f"{call} while the weights region sleeps (the adapter's A rows "
                               "live beside the weights): call wake_up(['weights']) first")

    def _adapter_changed(self) -> None:
        if not self._updating_weights:  # one sync (weights and adapter) makes one new version
            self.weights_version += 1
            self._updating_weights = True
        if self.pool.is_awake("kv_cache"):
            self.blocks.reset_prefix_cache()  # cached KV was computed by the old adapter
