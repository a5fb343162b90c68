"""Tests of paged_prefill_attention (handoff.rollout.kernels.prefill): packed new queries of
several sequences, some with cached prefixes, against a float32 per-sequence reference. CPU runs
the SDPA-loop backend; CUDA (`-m cuda`) runs varlen_attn (FlashAttention-2) in bf16 and fp8.
"""

from __future__ import annotations

import pytest
import torch
from paged_attention_oracles import make_case, prefill_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(seed, group, block_size, query_lens, context_lens, dtype, device, backend, fp8=False):
    from handoff.rollout.kernels import paged_prefill_attention

    case = make_case(seed, len(context_lens), 2 if device == "cpu" else 8, group,
                     32 if device == "cpu" else 128, block_size, context_lens, dtype, device,
                     fp8=fp8)
    gen = torch.Generator().manual_seed(seed + 1)
    q_THD = torch.randn(sum(query_lens), case["q"].shape[1], case["q"].shape[2],
                        generator=gen).to(device=device, dtype=dtype)
    out = paged_prefill_attention(q_THD, case["k_cache"], case["v_cache"],
                                  case["block_tables"], query_lens, context_lens,
                                  scale=case["scale"], k_scale=case["k_scale"],
                                  v_scale=case["v_scale"], backend=backend)
    ref = prefill_reference(case, q_THD, query_lens)
    assert out.shape == q_THD.shape and torch.isfinite(out).all()
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("block_size, group", [(16, 4), (24, 1), (64, 8)])
def test_cpu_prefill_with_cached_prefixes(block_size, group):
    err = _run(block_size + group, group, block_size, [5, 1, 40, 17], [37, 1, 40, 80],
               torch.float32, "cpu", "sdpa")
    assert err < 1e-5


def test_cpu_prefill_fp8_cache():
    err = _run(3, 4, 16, [9, 30], [20, 30], torch.float32, "cpu", "sdpa", fp8=True)
    assert err < 1e-5


def test_prefill_rejects_inconsistent_lengths():
    from handoff.errors import HandoffError
    from handoff.rollout.kernels import paged_prefill_attention

    case = make_case(0, 2, 2, 2, 32, 16, [10, 12], torch.float32, "cpu")
    q = torch.zeros(22, 4, 32)
    with pytest.raises(HandoffError, match="query_len <= context_len"):
        paged_prefill_attention(q, case["k_cache"], case["v_cache"], case["block_tables"],
                                [11, 11], [10, 12], scale=0.1)
    with pytest.raises(HandoffError, match="sum to"):
        paged_prefill_attention(q, case["k_cache"], case["v_cache"], case["block_tables"],
                                [10, 11], [10, 12], scale=0.1)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_cuda_varlen_prefill_matches_reference(block_size, group):
    err = _run(block_size * group, group, block_size, [300, 1, 77, 512, 40],
               [300, 129, 1000, 512, 41], torch.bfloat16, "cuda", "varlen")
    assert err < 1e-2


@cuda
@pytest.mark.cuda
def test_cuda_varlen_prefill_fp8_cache():
    err = _run(11, 4, 16, [64, 200], [100, 200], torch.bfloat16, "cuda", "varlen", fp8=True)
    assert err < 1e-2
