"""Model shapes: parameter counts of the presets, MoE + MLA counting, KV bytes per token."""

import json

import pytest

from handoff.errors import HandoffError
from handoff.plan.shapes import PRESETS, count_active_params, count_params, load_shape


@pytest.mark.parametrize("name, billions, rel", [
    ("deepseek-v3", 671, 0.005),   # the model card: 671B total (MTP layer excluded)
    ("qwen3-32b", 32.8, 0.005),    # the source: N = 32.8e9
    ("qwen3-30b-a3b", 30.5, 0.01),
    ("qwen2.5-7b", 7.61, 0.01),
    ("llama3-8b", 8.03, 0.005),
    ("llama3-70b", 70.6, 0.005),
])
def test_preset_param_counts(name, billions, rel):
    n = load_shape(name).num_params
    assert abs(n / 1e9 - billions) <= rel * billions, n


def test_moe_active_params():
    assert abs(load_shape("deepseek-v3").active_params / 1e9 - 37) < 1.0  # "37B activated"
    assert abs(load_shape("qwen3-30b-a3b").active_params / 1e9 - 3.3) < 0.1
    dense = load_shape("qwen3-8b")
    assert dense.active_params == dense.num_params and dense.num_experts == 0


def test_kv_bytes_per_token():
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB.
    assert load_shape("llama3-8b").kv_bytes_per_token == 128 * 1024
    # MLA caches the latent: (kv_lora_rank 512 + qk_rope_head_dim 64) per layer, 61 layers.
    assert load_shape("deepseek-v3").kv_bytes_per_token == 61 * (512 + 64) * 2


def test_config_json_path_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-8b"]))
    assert load_shape(str(tmp_path)).num_params == load_shape("qwen3-8b").num_params
    with pytest.raises(HandoffError, match="neither a preset"):
        load_shape("no-such-model")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(HandoffError, match="cannot read"):
        load_shape(str(tmp_path / "broken"))
    partial = {k: v for k, v in PRESETS["qwen3-8b"].items() if k != "hidden_size"}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    with pytest.raises(HandoffError, match="hidden_size"):
        load_shape(str(tmp_path / "partial.json"))


def _small(name, **fields):
    return {**PRESETS[name], "bos_token_id": 0, "eos_token_id": 1, **fields}


SMALL = {
    "deepseek-v3": _small("deepseek-v3", hidden_size=128, num_hidden_layers=3,
                          first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                          n_group=2, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
                          q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=16, intermediate_size=256,
                          moe_intermediate_size=32, vocab_size=300),
    "deepseek-v3-no-q-lora": _small("deepseek-v3", hidden_size=128, num_hidden_layers=2,
                                    first_k_dense_replace=1, n_routed_experts=4,
                                    num_experts_per_tok=2, n_group=1, topk_group=1,
                                    num_attention_heads=4, num_key_value_heads=4,
                                    q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                                    qk_rope_head_dim=8, v_head_dim=16, intermediate_size=256,
                                    moe_intermediate_size=32, vocab_size=300),
    "qwen3-moe": _small("qwen3-30b-a3b", hidden_size=128, num_hidden_layers=3, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=256,
                        vocab_size=300, head_dim=32, num_attention_heads=4,
                        num_key_value_heads=2, decoder_sparse_step=2, mlp_only_layers=[0]),
    "qwen2.5": _small("qwen2.5-7b", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, vocab_size=300),
    "llama3.1": _small("llama3.1-8b", hidden_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                       vocab_size=300),
    "tiny-qwen3": dict(PRESETS["tiny-qwen3"]),
    "tiny-llama": dict(PRESETS["tiny-llama"]),
    "qwen3-8b": dict(PRESETS["qwen3-8b"]),
}


@pytest.mark.parametrize("case", sorted(SMALL))
def test_count_matches_transformers(case):
    """The ledger's bytes are N x dtype size, so N must be exactly what transformers builds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(SMALL[case])
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert count_params({**fields, "model_type": model_type}) == built
    if case in ("deepseek-v3", "deepseek-v3-no-q-lora", "qwen3-moe"):
        assert count_active_params({**fields, "model_type": model_type}) < built
