"""Is a model config usable: a consistent shape for the plan, and one the runtime can run.

    check_shape_fields(cfg, name)   # HandoffError in one line for hidden_size=-64 and the like
    runtime_refusal(shape)          # None, or why handoff's engine and trainer cannot run it

The plan prices any decoder (MoE and MLA included: sizing a cluster is worth it), but a
verdict must not say "fits" for a model a run refuses at start. RUNNABLE_MODEL_TYPES mirrors
rollout.models.SUPPORTED_MODEL_TYPES (the plan imports no torch; a test keeps them equal).
"""

from __future__ import annotations

from typing import Any

from handoff.errors import HandoffError

RUNNABLE_MODEL_TYPES = ("qwen3", "qwen2", "llama")
# Fields every decoder config must hold as positive integers, then the ones that may be absent.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "intermediate_size")
_OPTIONAL = ("num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
             "n_routed_experts", "num_local_experts", "num_experts_per_tok", "kv_lora_rank",
             "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "decoder_sparse_step", "moe_layer_freq")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_shape_fields(cfg: dict, name: str) -> None:
    """Refuse, in one line, a shape field that is not a positive integer or that contradicts
    another (heads that the KV heads do not divide, a hidden size the heads do not split)."""
    fix = "fix the model's config.json or pick a preset"
    for key in _REQUIRED:
        if key not in cfg:
            raise HandoffError(f"model config {name!r} lacks field {key!r}: pass a complete HF "
                               "config.json or a preset")
    for key in (*_REQUIRED, *(k for k in _OPTIONAL if cfg.get(k) is not None)):
        if not _positive_int(cfg[key]):
            if key in _OPTIONAL and cfg[key] == 0:
                continue   # 0 means "none" for the optional counts (q_lora_rank: 0, ...)
            raise HandoffError(f"model config {name!r}: {key}={cfg[key]!r} is not a positive "
                               f"integer: {fix}")
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise HandoffError(f"model config {name!r}: num_attention_heads={heads} is not a "
                           f"multiple of num_key_value_heads={kv}: {fix}")
    if not cfg.get("head_dim") and not cfg.get("kv_lora_rank") and cfg["hidden_size"] % heads:
        raise HandoffError(f"model config {name!r}: hidden_size={cfg['hidden_size']} does not "
                           f"split into num_attention_heads={heads} heads (and no head_dim): "
                           f"{fix}")
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    if (cfg.get("num_experts_per_tok") or 0) > experts > 0:
        raise HandoffError(f"model config {name!r}: num_experts_per_tok="
                           f"{cfg['num_experts_per_tok']} exceeds the {experts} experts: {fix}")


def runtime_refusal(model_type: str, num_experts: int, kv_latent_dim: int) -> str | None:
    """Why a run cannot train this model (None: it can): handoff runs dense decoders only."""
    kinds = ", ".join(RUNNABLE_MODEL_TYPES)
    if num_experts or kv_latent_dim:
        layout = "mixture-of-experts" if num_experts else "multi-head latent attention"
        return (f"the runtime cannot run it: {layout} ({model_type or 'no model_type'}) is "
                f"priced for sizing only; handoff's engine and trainer run dense {kinds} "
                "decoders")
    if model_type not in RUNNABLE_MODEL_TYPES:
        return (f"the runtime cannot run it: model_type {model_type or None!r} is priced for "
                f"sizing only; handoff's engine and trainer run dense {kinds} decoders")
    return None
