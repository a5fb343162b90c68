"""The sampler: distributions, truncation, counter-based seeds, log-prob semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from handoff.config import RolloutConfig
from handoff.errors import HandoffError
from handoff.rollout.sampling import (SamplerRows, SamplingBatch, SamplingParams, draw, sample,
                                     sample_key, sampling_mode, uniforms)


def _batch(rows: int, *, temperature=1.0, top_p=1.0, top_k=0, seed=0) -> SamplingBatch:
    keys = np.array([sample_key(seed, i) for i in range(rows)], dtype=np.uint64)
    return SamplingBatch(temperature=np.full(rows, temperature, np.float32),
                         top_p=np.full(rows, top_p, np.float32),
                         top_k=np.full(rows, top_k, np.int64),
                         uniform=uniforms(keys, np.zeros(rows, np.uint64)))


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def test_params_validate_and_take_config_defaults():
    with pytest.raises(HandoffError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(HandoffError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(HandoffError, match="n=0"):
        SamplingParams(n=0)
    p = SamplingParams.from_config(RolloutConfig(temperature=0.6, n=8), seed=3)
    assert (p.temperature, p.n, p.seed, p.max_tokens) == (0.6, 8, 3, 64)


def test_uniforms_are_a_pure_function_of_key_and_step():
    keys = np.array([sample_key(1, 0), sample_key(1, 1), sample_key(2, 0)], dtype=np.uint64)
    u = uniforms(keys, np.array([0, 0, 0], dtype=np.uint64))
    assert len(set(u.tolist())) == 3 and ((0 <= u) & (u < 1)).all()
    assert uniforms(keys[1:2], np.array([0], dtype=np.uint64))[0] == u[1]
    assert uniforms(keys[:1], np.array([1], dtype=np.uint64))[0] != u[0]


def test_temperature_sampling_matches_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    rows = 20000
    for temperature in (1.0, 0.5):
        tokens, logprobs = sample(logits.expand(rows, -1), _batch(rows, temperature=temperature))
        expected = torch.softmax(logits / temperature, -1)
        assert (_frequencies(tokens, 5) - expected).abs().max() < 0.015
        assert torch.allclose(logprobs, expected.log()[tokens], atol=1e-6)


def test_top_k_and_top_p_truncate_then_renormalise():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, -1)
    tokens, logprobs = sample(logits, _batch(20000, top_k=2))
    assert torch.allclose(_frequencies(tokens, 4), torch.tensor([0.625, 0.375, 0, 0]), atol=0.015)
    # Log-probs are taken before truncation: the trainer's log-probs at T=1.
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)
    tokens, _ = sample(logits, _batch(20000, top_p=0.85))  # keeps 0.5 + 0.3 + 0.15
    assert torch.allclose(_frequencies(tokens, 4), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95,
                          atol=0.015)


def test_greedy_rows_take_the_argmax_with_raw_logprobs():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    batch = _batch(6, temperature=0.7)
    batch.temperature[::2] = 0.0
    tokens, logprobs = sample(logits, batch)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    assert torch.allclose(logprobs[::2], logits[::2].log_softmax(-1).max(-1).values)
    sampled = (logits[1::2] / 0.7).log_softmax(-1).gather(1, tokens[1::2, None]).squeeze(1)
    assert torch.allclose(logprobs[1::2], sampled)


def test_a_row_samples_the_same_whatever_shares_its_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 100, generator=gen)
    mixed = _batch(8, temperature=0.9, top_p=0.8, seed=4)
    mixed.top_k[3:] = 5
    mixed.temperature[5] = 0.0
    together, _ = sample(logits, mixed)
    for i in range(8):
        one = SamplingBatch(mixed.temperature[i:i + 1], mixed.top_p[i:i + 1],
                            mixed.top_k[i:i + 1], mixed.uniform[i:i + 1])
        alone, _ = sample(logits[i:i + 1], one)
        assert alone.item() == together[i].item()


def _on_device(batch: SamplingBatch) -> SamplerRows:
    return SamplerRows(temperature_B=torch.from_numpy(batch.temperature),
                       uniform_B=torch.from_numpy(batch.uniform),
                       top_k_B=torch.from_numpy(batch.top_k), top_p_B=torch.from_numpy(batch.top_p))


@pytest.mark.parametrize("case", ["greedy", "sample", "truncate", "mixed"])
def test_draw_on_staged_rows_equals_sample_in_every_mode(case):
    """What the decode graphs capture (draw on device tensors, greedy rows always honoured)
    draws what `sample` draws from the host's batch."""
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(2)) * 3
    batch = _batch(12, temperature=0.0 if case == "greedy" else 0.8,
                   top_p=0.7 if case == "truncate" else 1.0, seed=5)
    if case == "mixed":
        batch.temperature[[1, 4]] = 0.0
        batch.top_k[7:] = 3
    mode = sampling_mode(batch)
    assert mode == {"greedy": "greedy", "sample": "sample"}.get(case, "truncate")
    want = sample(logits, batch)
    rows = None if mode == "greedy" else _on_device(batch)
    got = draw(logits, rows, truncate=mode == "truncate")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
