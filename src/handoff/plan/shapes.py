"""Model shapes: parameter count, KV bytes per token, from an HF config.json or a preset.

The presets are HF `config.json` dicts, so the same entry drives `handoff plan` (counting)
and `handoff init-model` (writing a random-init checkpoint of that shape). No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from handoff.errors import HandoffError

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

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token at 2 bytes per element (bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def count_params(cfg: dict) -> int:
    """Dense decoder parameter count from HF config fields (Llama / Qwen2 / Qwen3 layout)."""
    h = cfg["hidden_size"]
    layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    vocab = cfg["vocab_size"]
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd
    if cfg.get("model_type") == "qwen3":
        attn += 2 * hd  # q_norm and k_norm
    mlp = 3 * h * inter
    norms = 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * (attn + mlp + norms) + embed + h


def shape_from_config(cfg: dict, name: str = "custom") -> ModelShape:
    try:
        heads = cfg["num_attention_heads"]
        return ModelShape(
            name=name, num_params=count_params(cfg), num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise HandoffError(f"model config {name!r} lacks field {e.args[0]!r}: pass a complete HF "
                           "config.json or a preset") from None


def load_hf_config(model: str) -> tuple[dict, str]:
    """A preset name, a config.json path, or a checkpoint directory -> (config dict, name)."""
    if model in PRESETS:
        return dict(PRESETS[model]), model
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise HandoffError(f"model {model!r} is neither a preset nor a readable config.json: use one "
                           f"of {', '.join(PRESETS)} or a path to an HF checkpoint directory")
    try:
        return json.loads(p.read_text()), p.parent.name or str(p)
    except (OSError, json.JSONDecodeError) as e:
        raise HandoffError(f"cannot read {str(p)!r} as JSON ({e}): point --model at a valid "
                           "HF config.json") from None


def load_shape(model: str) -> ModelShape:
    cfg, name = load_hf_config(model)
    return shape_from_config(cfg, name)
