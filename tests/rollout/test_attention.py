"""The plain-torch paged attention paths against dense attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from handoff.rollout.attention import (FP8_DTYPE, AttnMeta, paged_decode_attention_torch,
                                       prefill_attention_torch, select_decode_backend, store_kv)


def _dense(q_QHD, k_LKD, v_LKD, scale):
    """Reference: the last Q of L positions, causal, GQA by repeating KV heads."""
    group = q_QHD.shape[1] // k_LKD.shape[1]
    k = k_LKD.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v_LKD.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q_QHD.transpose(0, 1) @ k.transpose(1, 2) * scale
    num_q, num_k = q_QHD.shape[0], k_LKD.shape[0]
    visible = torch.arange(num_k)[None, :] <= torch.arange(num_q)[:, None] + num_k - num_q
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def _paged(contexts, block_size, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """Random per-sequence K/V scattered over shuffled blocks (block 0 left as the null block)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in contexts]
    num_blocks = sum(blocks_per_seq) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(contexts), max(blocks_per_seq), dtype=torch.int32)
    ks, vs = [], []
    for i, n in enumerate(contexts):
        ids = [order.pop() for _ in range(blocks_per_seq[i])]
        tables[i, :len(ids)] = torch.tensor(ids)
        k = torch.randn(n, kv_heads, head_dim, generator=gen)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        pos = torch.arange(n)
        slots = torch.tensor(ids)[pos // block_size] * block_size + pos % block_size
        store_kv(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    return k_cache, v_cache, tables, ks, vs


@pytest.mark.parametrize("block_size,group", [(1, 1), (4, 2), (16, 4), (5, 8)])
def test_decode_matches_dense(block_size, group):
    contexts = [1, 7, 33, 16]
    k_cache, v_cache, tables, ks, vs = _paged(contexts, block_size, 2, 16, seed=block_size)
    q = torch.randn(len(contexts), 2 * group, 16)
    out = paged_decode_attention_torch(q, k_cache, v_cache, tables,
                                       torch.tensor(contexts, dtype=torch.int32), scale=0.25)
    for i, n in enumerate(contexts):
        expected = _dense(q[i:i + 1], ks[i], vs[i], 0.25)[0]
        assert torch.allclose(out[i], expected, atol=1e-5)


def test_prefill_with_cached_prefix_matches_dense():
    contexts, new = [9, 20, 4], [3, 20, 1]  # the second sequence has no cached prefix
    k_cache, v_cache, tables, ks, vs = _paged(contexts, 4, 2, 8)
    q = torch.randn(sum(new), 4, 8)
    meta = AttnMeta(is_prefill=True, kv=None, block_tables_BM=tables, query_lens=new,
                    context_lens=contexts)
    out = prefill_attention_torch(q, k_cache, v_cache, meta, scale=0.3)
    start = 0
    for n_new, k, v in zip(new, ks, vs):
        expected = _dense(q[start:start + n_new], k, v, 0.3)
        assert torch.allclose(out[start:start + n_new], expected, atol=1e-5)
        start += n_new


def test_fp8_cache_stores_scaled_values_and_padding_hits_the_null_block():
    k_cache = torch.zeros(3, 4, 1, 8, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(2, 1, 8) * 3
    scale = torch.tensor(2.0)
    store_kv(k, k, k_cache, v_cache, torch.tensor([5, -1]), scale, scale)
    assert torch.allclose(k_cache[1, 1].float() * 2, k[0], rtol=0.07, atol=0.02)
    assert k_cache[2].float().abs().sum() == 0 and k_cache[1, 0].float().abs().sum() == 0
    assert k_cache[0, 0].float().abs().sum() > 0  # the padded row went to the null block
    q = torch.randn(1, 2, 8)
    out = paged_decode_attention_torch(q, k_cache, v_cache, torch.tensor([[0, 1]], dtype=torch.int32),
                                       torch.tensor([6], dtype=torch.int32), scale=0.3,
                                       k_scale=scale, v_scale=scale)
    ref = F.scaled_dot_product_attention(
        q[:, :, None], *(c.view(-1, 1, 8)[:6].float().transpose(0, 1)[None] * 2 for c in (k_cache,) * 2),
        scale=0.3, enable_gqa=True)
    assert torch.allclose(out, ref[:, :, 0], atol=1e-5)


def test_backend_choice_is_made_once_and_checked(monkeypatch):
    name, fn = select_decode_backend(torch.device("cpu"), torch.float32)
    assert name == "torch" and fn is paged_decode_attention_torch
    monkeypatch.setenv("HANDOFF_ATTENTION", "triton")
    with pytest.raises(Exception, match="triton"):
        select_decode_backend(torch.device("cpu"), torch.bfloat16)
