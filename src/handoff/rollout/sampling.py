"""Sampling parameters and the sampler: temperature, top-k, top-p, seeds, log-probs.

Randomness is counter-based, not stateful: the uniform number behind a sample's t-th token is
a hash of (request seed, sample index, t), and the token is drawn by inverse CDF over the
vocabulary in id order. So a seeded request yields the same tokens whatever else shares its
batch, and a sequence that is preempted and recomputed continues exactly where it stopped.

Log-prob semantics (what GRPO needs): each sampled token's log-prob is
log_softmax(logits / T)[token], taken BEFORE top-k / top-p truncation, with T = 1 for greedy
(temperature 0). At T = 1 this is exactly the raw model's log-prob, the quantity the trainer
recomputes, so the old-policy ratio starts at 1.

Shape legend: B = sequences in the batch, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from handoff.errors import HandoffError
from handoff.memory.host_copy import upload

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass
class SamplingParams:
    """How to sample one prompt's completions (vLLM-style names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    max_tokens: int = 64
    ignore_eos: bool = False
    # One length per sample (n of them), each in place of max_tokens: benchmark workloads
    # (rollout.response_lengths) give every sequence its own length.
    sample_max_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.sample_max_tokens = tuple(int(t) for t in self.sample_max_tokens)
        checks = [
            (self.temperature >= 0, f"temperature={self.temperature} is negative: use 0 (greedy) or more"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} is outside (0, 1]: use e.g. 0.95 or 1.0 (off)"),
            (self.top_k >= 0, f"top_k={self.top_k} is negative: use 0 (off) or a positive count"),
            (self.n >= 1, f"n={self.n} asks for no samples: use n >= 1"),
            (self.max_tokens >= 1, f"max_tokens={self.max_tokens} allows no tokens: use >= 1"),
            (self.seed is None or self.seed >= 0, f"seed={self.seed} is negative: use a seed >= 0"),
            (not self.sample_max_tokens or (len(self.sample_max_tokens) == self.n
                                            and min(self.sample_max_tokens) >= 1),
             f"sample_max_tokens={self.sample_max_tokens} must hold n={self.n} lengths >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise HandoffError(message)

    @classmethod
    def from_config(cls, cfg, **overrides) -> "SamplingParams":
        """Defaults from a RolloutConfig (temperature, top_p, top_k, n, max_tokens)."""
        base = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, n=cfg.n,
                    max_tokens=cfg.max_tokens)
        return cls(**{**base, **overrides})


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (numpy wraps on overflow, as wanted)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def seeded_per_prompt(params: SamplingParams, seed: int, prompts) -> list[SamplingParams]:
    """`params` for each prompt index in `prompts`, each with a seed of its own from `seed`:
    a request's seed keys its own samples only (as vLLM's does), so one seed for all would
    draw every prompt the same random stream."""
    return [replace(params, seed=sample_key(seed, i)) for i in prompts]


def sample_key(seed: int, sample_index: int) -> int:
    """The per-sequence stream key of sample `sample_index` of a request seeded with `seed`."""
    seed_arr = np.array([seed % 2**64], dtype=np.uint64)
    index_arr = np.array([sample_index], dtype=np.uint64)
    return int(_mix64(_mix64(seed_arr) + index_arr * _GOLDEN)[0])


def uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row, a pure function of (key, step): 53 random bits."""
    h = _mix64(keys.astype(np.uint64) + (steps.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step, built on the host from the scheduled sequences."""

    temperature: np.ndarray  # float32 [B]
    top_p: np.ndarray        # float32 [B]
    top_k: np.ndarray        # int64 [B]
    uniform: np.ndarray      # float64 [B]

    @property
    def all_greedy(self) -> bool:
        return not self.temperature.any()

    @property
    def any_greedy(self) -> bool:
        return not self.temperature.all()

    @property
    def needs_truncation(self) -> bool:
        return bool((self.top_k > 0).any() or (self.top_p < 1).any())


def _truncate(probs_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Zero the tokens outside top-k, then outside the top-p nucleus of what is left (HF order)."""
    vocab = probs_BV.shape[-1]
    # A stable sort keeps tie order a function of the row alone, hence batch-independent.
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True, stable=True)
    rank_V = torch.arange(vocab, device=probs_BV.device)
    k_B = torch.where(top_k_B > 0, top_k_B, vocab)
    keep_BV = rank_V[None, :] < k_B[:, None]
    sorted_BV = sorted_BV * keep_BV
    cum_BV = sorted_BV.cumsum(dim=-1)
    mass_before_BV = cum_BV - sorted_BV
    keep_BV &= mass_before_BV < top_p_B[:, None] * cum_BV[:, -1:]
    mask_BV = torch.zeros_like(keep_BV).scatter_(1, order_BV, keep_BV)
    return probs_BV * mask_BV


def sample(logits_BV: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (token ids int64 [B], their log-probs float32 [B])."""
    device = logits_BV.device
    rows = None if batch.all_greedy else SamplerRows(
        temperature_B=upload(batch.temperature, device),
        top_k_B=upload(batch.top_k, device) if batch.needs_truncation else None,
        top_p_B=upload(batch.top_p, device) if batch.needs_truncation else None,
        uniform_B=upload(batch.uniform, device))
    return draw(logits_BV, rows, truncate=batch.needs_truncation, mixed=batch.any_greedy)


@dataclass
class SamplerRows:
    """The sampler's per-row inputs on the device (temperature 0: greedy)."""

    temperature_B: torch.Tensor        # float32 [B]
    uniform_B: torch.Tensor            # float64 [B]
    top_k_B: torch.Tensor | None       # int64 [B]; None: no truncation
    top_p_B: torch.Tensor | None       # float32 [B]


def sampling_mode(batch: SamplingBatch) -> str:
    """Which of draw's paths a batch needs: "greedy", "sample" or "truncate"."""
    return "greedy" if batch.all_greedy else "truncate" if batch.needs_truncation else "sample"


def fused_draw_applies(logits_BV: torch.Tensor, truncate: bool) -> bool:
    """Whether `draw` of these logits takes the one-kernel draw (kernels/sampler.py): a
    sampled draw without truncation of half-precision logits on CUDA (HANDOFF_FUSED=0:
    never), at any batch: on an H200 (2026-12-05, `handoff bench engine`'s draw_ms, 151,936
    tokens) it took 0.068 / 0.070 / 0.118 ms at 1 / 32 / 256 rows against the torch path's
    0.100 / 0.467 / 1.168. It allocates nothing of [rows, V]: its rows need no splitting."""
    from handoff.rollout.ops import use_fused

    return not truncate and use_fused(logits_BV)


def draw(logits_BV: torch.Tensor, rows: SamplerRows | None, *, truncate: bool = False,
         mixed: bool = True, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler on device tensors alone (no host branch on values, so it can be captured
    in a CUDA graph): rows None draws greedily; `mixed` lets rows of temperature 0 take the
    argmax inside a sampled batch; `truncate` applies top-k / top-p. A sampled draw without
    truncation on CUDA is one kernel (fused_draw_applies; rows of temperature 0 always take
    the argmax there, which `mixed` only skips for batches without such rows); `fused`
    True/False forces it on or off (a bench's A/B), None decides."""
    if fused is None:
        fused = fused_draw_applies(logits_BV, truncate)
    if rows is not None and not truncate and fused:
        from handoff.rollout.kernels.sampler import fused_draw

        return fused_draw(logits_BV, rows.temperature_B, rows.uniform_B)
    logits_BV = logits_BV.float()
    if rows is None:
        tokens_B = logits_BV.argmax(dim=-1)
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    else:
        temp_B = rows.temperature_B
        logprobs_BV = torch.log_softmax(
            logits_BV / torch.where(temp_B == 0, 1.0, temp_B)[:, None], dim=-1)
        probs_BV = logprobs_BV.exp()
        if truncate:
            probs_BV = _truncate(probs_BV, rows.top_k_B, rows.top_p_B)
        cdf_BV = probs_BV.cumsum(dim=-1, dtype=torch.float64)
        target_B1 = (rows.uniform_B * cdf_BV[:, -1])[:, None]
        tokens_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(1)
        tokens_B.clamp_(max=logits_BV.shape[-1] - 1)
        # Rounding at the top of the CDF can land on a zero-probability tail token: fall back
        # to the mode rather than emit a token the truncation removed.
        picked_B = probs_BV.gather(1, tokens_B[:, None]).squeeze(1)
        tokens_B = torch.where(picked_B > 0, tokens_B, probs_BV.argmax(dim=-1))
        if mixed:
            tokens_B = torch.where(temp_B == 0, logits_BV.argmax(dim=-1), tokens_B)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
