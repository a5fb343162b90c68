"""The engine's LoRA on a GPU: decode graphs captured with the adapter path equal eager decode.

Run on the device: python3 -m pytest -q -m cuda tests/rollout/test_engine_lora_cuda.py
An engine built with `lora_max_rank` captures its graphs over the zero adapter buffers; an
adapter loaded later is copied into the same addresses, so the graphs (never recaptured)
compute with it and give eager decode's tokens, and clear_adapter gives the base engine's.
"""

from __future__ import annotations

import pytest
import torch

from handoff.rollout.engine import Engine
from handoff.rollout.models import iter_checkpoint
from handoff.rollout.sampling import SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RANK, ALPHA = 4, 8
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + (5 * i) % 40)] for i in range(19)]
PARAMS = [SamplingParams(temperature=0.0, n=2, max_tokens=4 + 3 * i, ignore_eos=True)
          for i in range(19)]


def _random_adapter(model_dir) -> dict[str, torch.Tensor]:
    """A PEFT-named adapter of rank 4 on all seven projections, A and B non-zero."""
    gen = torch.Generator().manual_seed(3)
    adapter = {}
    for name, weight in iter_checkpoint(model_dir):
        if name.endswith("_proj.weight"):
            out_features, in_features = weight.shape
            stem = "base_model.model." + name.removesuffix(".weight")
            adapter[f"{stem}.lora_A.weight"] = torch.randn(RANK, in_features, generator=gen) / in_features ** 0.5
            adapter[f"{stem}.lora_B.weight"] = torch.randn(out_features, RANK, generator=gen) * 0.5
    return adapter


def _tokens(engine: Engine) -> list[list[int]]:
    return [s.token_ids for o in engine.generate(PROMPTS, PARAMS) for s in o.outputs]


@pytest.mark.parametrize("gemm", ["cublas", "triton"])
def test_graphs_with_an_adapter_equal_eager_and_are_not_recaptured(qwen3_dir, ref, gemm):
    """Also with the Triton skinny product (rollout.decode_gemm=triton: the slot's shrink in
    the base product's launch at <= 16 rows), whose base rows do not depend on the slot."""
    cfg = {"num_blocks": 1024, "block_size": 16, "max_num_seqs": 64, "decode_gemm": gemm}
    base = Engine(str(qwen3_dir), ref.cfg(**cfg), dtype="bfloat16")
    graph = Engine(str(qwen3_dir), ref.cfg(**cfg), dtype="bfloat16", lora_max_rank=8)
    eager = Engine(str(qwen3_dir), ref.cfg(**cfg, cuda_graphs=False), dtype="bfloat16",
                   lora_max_rank=8)
    captures = graph.stats()["graph_captures"]
    assert captures > 0
    base_tokens = _tokens(base)
    assert _tokens(graph) == base_tokens    # zero adapter: the base's tokens
    adapter = _random_adapter(qwen3_dir)
    for engine in (graph, eager):
        engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    with_adapter = _tokens(eager)
    assert with_adapter != base_tokens
    assert _tokens(graph) == with_adapter
    graph.load_adapter(adapter, alpha=ALPHA, rank=RANK)   # a sync: same addresses, same tokens
    assert _tokens(graph) == with_adapter
    graph.clear_adapter()
    assert _tokens(graph) == base_tokens
    assert graph.stats()["graph_captures"] == captures
    for engine in (base, graph, eager):
        engine.sleep(2)


def test_the_term_left_to_its_reader_gives_the_expands_tokens(qwen3_dir, ref, monkeypatch):
    """A decode step's q/k/v and gate/up terms added by qk_norm_rope_store and silu_mul
    (ops.PendingTerm, the default) against their own expand GEMMs (HANDOFF_LORA_FOLD=0), in
    captured graphs and eager prefill. B's entries are +-2^-k: each product t_r B_r is exact
    and so is their sum, so both ways round y + t B^T once from the same fp32 value and the
    tokens must be equal (random B's sums differ in the order of their roundings, an ulp,
    which can flip a greedy token of a random model)."""
    from handoff.rollout.kernels import fused

    terms = []
    for name in ("silu_mul", "qk_norm_rope_store"):
        kernel = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _k=kernel, **kw: terms.append(
            kw.get("term") is not None) or _k(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    adapter = {name: (torch.randint(0, 2, value.shape, generator=gen) * 2 - 1)
               * 2.0 ** -torch.randint(1, 4, value.shape, generator=gen).float()
               if ".lora_B." in name else value
               for name, value in _random_adapter(qwen3_dir).items()}
    cfg = ref.cfg(num_blocks=1024, block_size=16, max_num_seqs=64)
    tokens = {}
    for fold in ("0", "1"):
        monkeypatch.setenv("HANDOFF_LORA_FOLD", fold)
        terms.clear()
        engine = Engine(str(qwen3_dir), cfg, dtype="bfloat16", lora_max_rank=8)
        engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
        tokens[fold] = _tokens(engine)
        assert any(terms) == (fold == "1") and not all(terms)   # long prefills expand
        engine.sleep(2)
    assert tokens["1"] == tokens["0"]
