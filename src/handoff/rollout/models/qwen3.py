"""The decoder of the Qwen3, Qwen2 and Llama families in the engine's layout.

One model with flags covers the three: Qwen3 adds RMSNorm on each head of q and k, Qwen2 adds
a bias to q/k/v, Llama may bias every projection. The engine layout fuses q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj`; `load_weights` takes HF names and full tensors
(from a checkpoint or from the trainer) and copies them into the fused rows. Tied embeddings
use the embedding matrix as the head (no separate parameter, so a sync updates both).

Tokens are packed flat (no batch dimension): a forward takes T tokens of any mix of sequences
plus an AttnMeta that says where each token's K/V goes and what each query attends to.

Shape legend: T = tokens, E = hidden size, H = query heads, K = KV heads, D = head dim,
I = intermediate size, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from handoff.errors import HandoffError
from handoff.rollout.attention import AttnMeta, attend
from handoff.rollout.layers import Linear, RMSNorm, apply_rope

# HF projection name -> (engine module name, shard index inside the fused weight)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
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


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_index: int, **kw):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias,
                               shard_sizes=(q_size, kv_size, kv_size), **kw)
        self.o_proj = Linear(q_size, spec.hidden_size, bias=spec.o_bias, **kw)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, **kw) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, **kw) if spec.qk_norm else None
        self.scale = spec.head_dim ** -0.5

    def forward(self, x_TE: torch.Tensor, cos_T1D2: torch.Tensor, sin_T1D2: torch.Tensor,
                meta: AttnMeta) -> torch.Tensor:
        num_tokens = x_TE.shape[0]
        q_TX, k_TX, v_TX = self.qkv_proj(x_TE).split(self.qkv_proj.shard_sizes, dim=-1)
        q_THD = q_TX.view(num_tokens, self.num_heads, self.head_dim)
        k_TKD = k_TX.view(num_tokens, self.num_kv_heads, self.head_dim)
        v_TKD = v_TX.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_THD, k_TKD = self.q_norm(q_THD), self.k_norm(k_TKD)
        q_THD = apply_rope(q_THD, cos_T1D2, sin_T1D2)
        k_TKD = apply_rope(k_TKD, cos_T1D2, sin_T1D2)
        o_THD = attend(q_THD, k_TKD, v_TKD, meta, self.layer_index, scale=self.scale)
        return self.o_proj(o_THD.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, **kw):
        super().__init__()
        inter = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * inter, bias=spec.mlp_bias,
                                   shard_sizes=(inter, inter), **kw)
        self.down_proj = Linear(inter, spec.hidden_size, bias=spec.mlp_bias, **kw)

    def forward(self, x_TE: torch.Tensor) -> torch.Tensor:
        gate_TI, up_TI = self.gate_up_proj(x_TE).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate_TI) * up_TI)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_index: int, **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.self_attn = Attention(spec, layer_index, **kw)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.mlp = MLP(spec, **kw)

    def forward(self, x_TE, cos_T1D2, sin_T1D2, meta):
        x_TE = x_TE + self.self_attn(self.input_layernorm(x_TE), cos_T1D2, sin_T1D2, meta)
        return x_TE + self.mlp(self.post_attention_layernorm(x_TE))


class Backbone(nn.Module):
    def __init__(self, spec: DecoderSpec, **kw):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=torch.empty(
            spec.vocab_size, spec.hidden_size, device=kw["device"], dtype=kw["dtype"]),
            _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, **kw) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)


class CausalLM(nn.Module):
    """Qwen3 / Qwen2 / Llama causal LM. `rope_cos_sin` is set by the runner (not a weight)."""

    def __init__(self, spec: DecoderSpec, *, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        kw = {"device": device, "dtype": dtype}
        self.model = Backbone(spec, **kw)
        self.lm_head = (None if spec.tie_word_embeddings
                        else Linear(spec.hidden_size, spec.vocab_size, bias=False, **kw))
        self.rope_cos_sin: torch.Tensor | None = None  # [max_len, D] fp32, outside the weights
        self._target_cache: dict | None = None

    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                meta: AttnMeta) -> torch.Tensor:
        """Final hidden states [T, E] of the packed tokens."""
        x_TE = self.model.embed_tokens(input_ids_T)
        cos_sin_TD = self.rope_cos_sin[positions_T].to(x_TE.dtype)
        cos_T1D2, sin_T1D2 = cos_sin_TD[:, None, :].chunk(2, dim=-1)
        for layer in self.model.layers:
            x_TE = layer(x_TE, cos_T1D2, sin_T1D2, meta)
        return self.model.norm(x_TE)

    def compute_logits(self, hidden_BE: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_BE, weight)

    def _targets(self) -> dict[str, tuple[nn.Parameter, Linear | None]]:
        """Engine parameter name -> (parameter, its fused Linear or None)."""
        out = {}
        for mod_name, module in self.named_modules():
            for p_name, param in module.named_parameters(recurse=False):
                fused = module if isinstance(module, Linear) and len(module.shard_sizes) > 1 else None
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = (param, fused)
        return out

    def locate(self, hf_name: str) -> tuple[torch.Tensor, str] | None:
        """The engine view that holds HF tensor `hf_name` and its coverage key (None: ignored)."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        if hf_name == "lm_head.weight" and self.lm_head is None:
            return None
        module_name, _, leaf = hf_name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        shard = None
        if proj in _FUSED:
            fused_name, shard = _FUSED[proj]
            module_name = f"{parent}.{fused_name}"
        name = f"{module_name}.{leaf}"
        if self._target_cache is None:
            self._target_cache = self._targets()
        if name not in self._target_cache:
            raise HandoffError(f"weight {hf_name!r} has no place in the engine's "
                               f"{self.spec.model_type} layout: check that the checkpoint "
                               "matches its config.json (model_type, bias flags, tying)")
        param, fused = self._target_cache[name]
        if shard is None:
            return param, name
        return param.narrow(0, *fused.shard_slice(shard)), f"{name}[{shard}]"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named full tensors into the engine layout; returns the keys touched."""
        touched: set[str] = set()
        for hf_name, tensor in weights:
            found = self.locate(hf_name)
            if found is None:
                continue
            dest, key = found
            if tuple(dest.shape) != tuple(tensor.shape):
                raise HandoffError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the engine "
                                   f"expects {tuple(dest.shape)}: the checkpoint and config.json "
                                   "disagree")
            dest.copy_(tensor)
            touched.add(key)
        return touched

    def weight_keys(self) -> set[str]:
        """What `load_weights` must touch for a complete model (fused shards as `name[i]`)."""
        keys = set()
        for name, (_, fused) in self._targets().items():
            shards = range(len(fused.shard_sizes)) if fused is not None else [None]
            keys |= {name if s is None else f"{name}[{s}]" for s in shards}
        return keys
