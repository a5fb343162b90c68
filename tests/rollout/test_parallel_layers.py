"""Shard arithmetic of the tensor-parallel engine, in one process (no collectives needed).

Every rank's model is built with its TPGroup and loads the same full checkpoint: what the
ranks keep must tile each full tensor exactly (KV heads and vocabulary padding included),
`export` must equal `select` of the full tensor, and sizes TP cannot split are refused.
"""

import pytest
import torch

from handoff.errors import HandoffError
from handoff.model_files import ModelFiles
from handoff.rollout.models import build_model, iter_checkpoint, spec_from_hf_config
from handoff.rollout.layers import kv_head_split, vocab_split
from handoff.rollout.parallel import TPGroup


def rank_models(path, tp_size: int):
    spec = spec_from_hf_config(ModelFiles.open(path).config)
    models = []
    for rank in range(tp_size):
        model = build_model(spec, device=torch.device("cpu"), dtype=torch.float32,
                            tp=TPGroup(rank=rank, size=tp_size))
        assert model.load_weights(iter_checkpoint(path)) == model.weight_keys()
        models.append(model)
    return spec, models


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_shards_tile_every_full_tensor(qwen3_dir, tp_size):
    spec, models = rank_models(qwen3_dir, tp_size)
    for name, full in iter_checkpoint(qwen3_dir):
        covered = torch.zeros(full.shape, dtype=torch.int64)
        for model in models:
            _, rule, _ = model.locate(name)
            assert torch.equal(model.export(name), model.select(name, full))
            assert torch.equal(model.export(name), rule.src(full))
            rule.src(covered).add_(1)
        # k/v rows are copied to TP / KV-heads ranks when TP exceeds the KV heads.
        copies = max(tp_size // spec.num_kv_heads, 1) if name.endswith(("k_proj.weight",
                                                                      "v_proj.weight")) else 1
        replicated = full.dim() == 1 or "norm" in name
        expected = tp_size if replicated else copies
        assert (covered == expected).all(), name


def test_rank_shapes_follow_the_split(qwen3_dir):
    spec, (rank0, rank1) = rank_models(qwen3_dir, 2)
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
    for model in (rank0, rank1):
        assert (model.spec.num_heads, model.spec.num_kv_heads) == (2, 1)
        assert model.spec.intermediate_size == spec.intermediate_size // 2
        attn = model.model.layers[0].self_attn
        assert tuple(attn.qkv_proj.weight.shape) == (4 * spec.head_dim, spec.hidden_size)
        assert tuple(attn.o_proj.weight.shape) == (spec.hidden_size, 2 * spec.head_dim)
        assert model.model.embed_tokens.weight.shape[0] == spec.vocab_size // 2
    assert model.full_spec == spec


def test_kv_heads_replicated_by_query_group():
    # 2 KV heads over 4 ranks: ranks 0-1 read head 0, ranks 2-3 head 1 (HF GQA grouping).
    assert [kv_head_split(2, TPGroup(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_split(8, TPGroup(r, 2)) for r in range(2)] == [(0, 4), (4, 4)]
    with pytest.raises(HandoffError, match="num_key_value_heads=3"):
        kv_head_split(3, TPGroup(0, 2))


def test_vocab_split_pads_the_last_rank():
    # 10 ids over 4 ranks: 3 rows each, the last keeps one id and two padding rows.
    assert [vocab_split(10, TPGroup(r, 4)) for r in range(4)] == [(0, 3, 3), (3, 3, 3),
                                                                   (6, 3, 3), (9, 1, 3)]


def test_tp_that_does_not_split_the_heads_is_refused(qwen3_dir):
    spec = spec_from_hf_config(ModelFiles.open(qwen3_dir).config)
    with pytest.raises(HandoffError, match="does not divide num_attention_heads=4"):
        build_model(spec, device=torch.device("cpu"), dtype=torch.float32, tp=TPGroup(0, 3))
