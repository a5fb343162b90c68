"""The decoder of the Qwen3, Qwen2 and Llama families in the engine's layout.

One model with flags covers the three: Qwen3 adds RMSNorm on each head of q and k, Qwen2 adds
a bias to q/k/v, Llama may bias every projection. The engine layout fuses q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj`; `load_weights` takes HF names and full tensors
(from a checkpoint or from the trainer) and copies this rank's part into the fused rows.
Tied embeddings use the embedding matrix as the head (no separate parameter, so a sync
updates both).

Tensor parallelism (layers.py, parallel.py): attention heads, KV heads (replicated when TP >
KV heads), the MLP's intermediate size and the vocabulary are split over the TP group, and
`model.spec` is the shape ONE rank computes with (its heads, KV heads, intermediate size;
full hidden size and vocabulary), so the runner sizes the KV pool for this rank's KV heads
only. `model.full_spec` is the checkpoint's shape.

Tokens are packed flat (no batch dimension): a forward takes T tokens of any mix of sequences
plus an AttnMeta that says where each token's K/V goes and what each query attends to.

Shape legend: T = tokens, E = hidden size, H = query heads, K = KV heads, D = head dim,
I = intermediate size, V = vocabulary (heads and I are this rank's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from handoff.errors import HandoffError
from handoff.rollout.attention import AttnMeta, attend
from handoff.rollout import ops
from handoff.rollout.layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm,
                                    RowParallelLinear, ShardRule, VocabParallelEmbedding,
                                    even_split, kv_head_split, shard_rules)
from handoff.rollout.parallel import SINGLE, TPGroup
from handoff.rollout.weight_copy import copy_in_batches

# HF projection name -> (engine module name, part index inside the fused weight)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class DecoderSpec:
    """Everything the engine needs from an HF config.json (see models.spec_from_hf_config)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool

    def for_rank(self, tp: TPGroup) -> "DecoderSpec":
        """The shape one rank of `tp` computes with (raises when TP does not split the model)."""
        if tp.size == 1:
            return self
        even_split(self.num_heads, tp, "num_attention_heads")
        even_split(self.intermediate_size, tp, "intermediate_size")
        return dataclasses.replace(self, num_heads=self.num_heads // tp.size,
                                   num_kv_heads=kv_head_split(self.num_kv_heads, tp)[1],
                                   intermediate_size=self.intermediate_size // tp.size)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_index: int, tp: TPGroup, **kw):
        super().__init__()
        self.layer_index = layer_index
        d = spec.head_dim
        head_start, self.num_heads = even_split(spec.num_heads, tp, "num_attention_heads")
        kv_start, self.num_kv_heads = kv_head_split(spec.num_kv_heads, tp)
        self.head_dim = d
        q_part = (spec.num_heads * d, head_start * d, self.num_heads * d)
        kv_part = (spec.num_kv_heads * d, kv_start * d, self.num_kv_heads * d)
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, [q_part, kv_part, kv_part],
                                             bias=spec.qkv_bias, **kw)
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, bias=spec.o_bias,
                                        tp=tp, **kw)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps, **kw) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps, **kw) if spec.qk_norm else None
        self.scale = d ** -0.5

    def forward(self, x_TE: torch.Tensor | ops.NormInput, positions_T: torch.Tensor,
                rope_LD: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        num_tokens = x_TE.shape[0]
        q_norm = self.q_norm.weight if self.q_norm is not None else None
        k_norm = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        qkv_TF = self.qkv_proj(x_TE)
        if meta.prefetch is not None:   # the side stream asks for the next weights meanwhile
            meta.prefetch.after_qkv(self.layer_index)
        q_THD, k_TKD, v_TKD = ops.qk_norm_rope_store(
            qkv_TF, self.num_heads, self.num_kv_heads, self.head_dim, positions_T,
            rope_LD, q_norm, k_norm, eps, meta, self.layer_index)
        o_THD = attend(q_THD, k_TKD, v_TKD, meta, self.layer_index, scale=self.scale)
        return self.o_proj(o_THD.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TPGroup, **kw):
        super().__init__()
        inter = spec.intermediate_size
        start, per = even_split(inter, tp, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, [(inter, start, per)] * 2,
                                                 bias=spec.mlp_bias, **kw)
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, bias=spec.mlp_bias, tp=tp,
                                           **kw)

    def forward(self, x_TE: torch.Tensor | ops.NormInput) -> torch.Tensor:
        # silu_mul inside down_proj's product: one launch fewer where the skinny kernel runs
        return self.down_proj(self.gate_up_proj(x_TE), gated=True)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_index: int, tp: TPGroup, **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.self_attn = Attention(spec, layer_index, tp, **kw)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.mlp = MLP(spec, tp, **kw)

    def forward(self, x_TE, residual_TE, positions_T, rope_LD, meta):
        """(this layer's output, the residual stream before it): the next norm adds them.
        Each norm is left to the projection that reads it (RMSNorm.pending), which sets the
        stream after it."""
        normed = self.input_layernorm.pending(x_TE, residual_TE)
        h_TE = self.self_attn(normed, positions_T, rope_LD, meta)
        normed = self.post_attention_layernorm.pending(h_TE, normed.residual_out)
        out_TE = self.mlp(normed)
        if meta.prefetch is not None:
            meta.prefetch.join()
        return out_TE, normed.residual_out


class Backbone(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TPGroup, **kw):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp=tp, **kw)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, tp, **kw)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)


class CausalLM(nn.Module):
    """Qwen3 / Qwen2 / Llama causal LM. `rope_cos_sin` is set by the runner (not a weight)."""

    def __init__(self, spec: DecoderSpec, *, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.full_spec = spec
        self.spec = spec.for_rank(tp)
        self.tp = tp
        kw = {"device": device, "dtype": dtype}
        self.model = Backbone(spec, tp, **kw)
        self.lm_head = (None if spec.tie_word_embeddings
                        else ParallelLMHead(spec.vocab_size, spec.hidden_size, tp=tp, **kw))
        self.rope_cos_sin: torch.Tensor | None = None  # [max_len, D] fp32, outside the weights
        self._target_cache: dict | None = None
        self._load_plan: dict[str, tuple | None] = {}

    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                meta: AttnMeta) -> torch.Tensor:
        """Final hidden states [T, E] of the packed tokens."""
        x_TE, residual_TE = self.model.embed_tokens(input_ids_T), None
        for layer in self.model.layers:
            x_TE, residual_TE = layer(x_TE, residual_TE, positions_T, self.rope_cos_sin, meta)
        return self.model.norm.add_and_norm(x_TE, residual_TE)[0]

    def compute_logits(self, hidden_BE: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, V], the same on every TP rank."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden_BE)

    def _targets(self) -> dict[str, nn.Parameter]:
        """Engine parameter name -> parameter."""
        return {name: param for name, param in self.named_parameters()}

    def locate(self, hf_name: str) -> tuple[torch.Tensor, ShardRule, str] | None:
        """(engine parameter, the rule of this rank's part, coverage key) for HF tensor
        `hf_name`; None for tensors the engine ignores."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        if hf_name == "lm_head.weight" and self.lm_head is None:
            return None
        module_name, _, leaf = hf_name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        part = None
        if proj in FUSED:
            fused_name, part = FUSED[proj]
            module_name = f"{parent}.{fused_name}"
        name = f"{module_name}.{leaf}"
        if self._target_cache is None:
            self._target_cache = self._targets()
        if name not in self._target_cache:
            raise HandoffError(f"weight {hf_name!r} has no place in the engine's "
                               f"{self.spec.model_type} layout: check that the checkpoint "
                               "matches its config.json (model_type, bias flags, tying)")
        param = self._target_cache[name]
        rules = shard_rules(param)
        if part is None:
            return param, rules[0], name
        return param, rules[part], f"{name}[{part}]"

    def export(self, hf_name: str) -> torch.Tensor:
        """This rank's part of HF tensor `hf_name`, as the engine holds it (a view)."""
        param, rule, _ = self._require(hf_name)
        return rule.dest(param)

    def select(self, hf_name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of the full HF tensor `hf_name` that this rank keeps (a view)."""
        return self._require(hf_name)[1].src(full)

    def _require(self, hf_name: str) -> tuple[torch.Tensor, ShardRule, str]:
        found = self.locate(hf_name)
        if found is None:
            raise HandoffError(f"weight {hf_name!r} is not kept by the engine: export a model weight")
        return found

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy this rank's part of HF-named full tensors into the engine layout; returns the
        keys touched.

        The copies go out in batches (one `_foreach_copy_` per ~256 MiB), and each name's
        destination is looked up once per engine: a sync of a few hundred tensors is bound
        by the host's per-tensor work, not by the copies.
        """
        touched: set[str] = set()

        def copies():
            for hf_name, tensor in weights:
                target = self._load_target(hf_name)
                if target is None:
                    continue
                dest, rule, key, expected, nbytes = target
                if tuple(tensor.shape) != expected:
                    raise HandoffError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the "
                                       f"engine expects {expected}: the checkpoint and "
                                       "config.json disagree")
                touched.add(key)
                yield dest, rule.src(tensor), nbytes

        copy_in_batches(copies())
        return touched

    def _load_target(self, hf_name: str):
        """(destination view, rule, coverage key, expected full shape, destination bytes) of
        `hf_name`, or None for a tensor the engine ignores; computed once per name."""
        if hf_name not in self._load_plan:
            found = self.locate(hf_name)
            if found is not None:
                param, rule, key = found
                dest = rule.dest(param)
                found = (dest, rule, key, rule.full_shape(dest), dest.numel() * dest.element_size())
            self._load_plan[hf_name] = found
        return self._load_plan[hf_name]

    def weight_keys(self) -> set[str]:
        """What `load_weights` must touch for a complete model (fused parts as `name[i]`)."""
        keys = set()
        for name, param in self._targets().items():
            rules = shard_rules(param)
            keys |= {name} if len(rules) == 1 else {f"{name}[{i}]" for i in range(len(rules))}
        return keys
