"""Shared fixtures for the rollout engine tests: tiny checkpoints with lively weights.

`init_model` draws weights with std 0.02, which makes a tiny random model repeat its last
token forever: a test of greedy equality would then pass for almost any engine. The
checkpoints here are re-drawn with unit-gain weights so outputs vary token to token, and the
special-token rows of the (tied) embedding are shrunk so generations rarely hit EOS early.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from handoff.config import RolloutConfig

def write_lively_checkpoint(preset: str, out: Path, seed: int = 1) -> Path:
    from safetensors.torch import load_file, save_file

    from handoff.modelzoo import init_model

    init_model(preset, out, dtype="float32")
    state = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, value in state.items():
        if value.dim() == 2:
            gain = 0.5 if "embed" in name else 2.0
            state[name] = torch.randn(value.shape, generator=gen) * gain / value.shape[1] ** 0.5
        else:
            state[name] = 1 + 0.1 * torch.randn(value.shape, generator=gen)
    state["model.embed_tokens.weight"][256:260] *= 0.05
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return write_lively_checkpoint("tiny-qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return write_lively_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, one prompt at a time (no padding in the reference)."""
    out = hf_model(str(path)).generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                       do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(path, prompt: list[int], completion: list[int],
                temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each completion token under one transformers forward."""
    logits = hf_model(str(path))(torch.tensor([prompt + completion])).logits[0].float()
    logp = (logits[len(prompt) - 1:-1] / temperature).log_softmax(-1)
    return logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def rollout_cfg(**overrides) -> RolloutConfig:
    # One BLAS library: engines compared bit for bit must not each time their own choice
    # (test_graphs_cuda tests decode_gemm=auto on its own).
    base = dict(num_blocks=128, block_size=4, max_model_len=128, max_num_seqs=16,
                decode_gemm="cublas")
    return RolloutConfig(**{**base, **overrides})


@torch.no_grad()
def hf_logits(path, token_ids: list[int]) -> torch.Tensor:
    """Raw logits [T, V] of one transformers forward."""
    return hf_model(str(path))(torch.tensor([token_ids])).logits[0].float()


class Reference:
    """The transformers side of every equivalence test, as a fixture."""

    write_checkpoint = staticmethod(write_lively_checkpoint)
    logits = staticmethod(hf_logits)
    greedy = staticmethod(hf_greedy)
    logprobs = staticmethod(hf_logprobs)
    cfg = staticmethod(rollout_cfg)
    mixed_prompts = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 9, list(range(100, 113)), [42]]


@pytest.fixture(scope="session")
def ref() -> Reference:
    return Reference()
