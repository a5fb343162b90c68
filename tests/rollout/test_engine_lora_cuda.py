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


def test_the_terms_in_triton_give_the_expand_gemms_logits(qwen3_dir, ref, monkeypatch):
    """A forward of few rows with the terms in Triton (the default: q/k/v's and gate/up's
    added by qk_norm_rope_store and silu_mul as they read, o's and down's by add_term)
    against every term an expand GEMM of cuBLAS's (HANDOFF_LORA_FOLD=0): the logits agree
    within bf16's rounding, far closer than the adapter moves them. (Greedy tokens are no
    test here: the two ways sum in other orders, and an ulp flips a token of a random
    model; the kernels' own sums: test_kernels_fused.py.)"""
    from handoff.rollout import ops
    from handoff.rollout.attention import AttnMeta
    from handoff.rollout.kernels import fused

    calls = []
    for name in ("silu_mul", "qk_norm_rope_store", "add_term"):
        monkeypatch.setattr(fused, name, _counted(getattr(fused, name), name, calls))
    engine = Engine(str(qwen3_dir), ref.cfg(num_blocks=1024, block_size=16, max_num_seqs=64),
                    dtype="bfloat16", lora_max_rank=8)
    prompts = PROMPTS[:6]
    ids = torch.tensor([t for p in prompts for t in p], device=engine.device)
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).to(engine.device)
    meta = AttnMeta(is_prefill=True, kv=None, query_lens=[len(p) for p in prompts])
    assert len(ids) <= ops.FOLD_MAX_ROWS   # rows whose terms are Triton's

    def logits(fold: str) -> torch.Tensor:
        monkeypatch.setenv("HANDOFF_LORA_FOLD", fold)
        calls.clear()
        with torch.inference_mode():
            return engine.model.compute_logits(engine.model(ids, positions, meta)).float()

    engine.load_adapter(_random_adapter(qwen3_dir), alpha=ALPHA, rank=RANK)
    in_triton = logits("1")
    layers = engine.spec.num_layers
    assert sorted(calls) == sorted(["add_term"] * 2 * layers + ["qk_norm_rope_store"] * layers
                                   + ["silu_mul"] * layers)
    expanded = logits("0")
    assert calls == []
    engine.clear_adapter()
    base = logits("0")
    moved = (expanded - base).abs().max().item()
    assert moved > 0.5
    assert (in_triton - expanded).abs().max().item() <= 0.05 * moved
    engine.sleep(2)


def _counted(kernel, name: str, calls: list):
    """`kernel`, noting its name in `calls` where it adds a LoRA term."""
    def run(*args, **kw):
        if name == "add_term" or kw.get("term") is not None:
            calls.append(name)
        return kernel(*args, **kw)
    return run


def test_a_sync_replayed_from_its_graph_writes_the_sources_values_now(qwen3_dir, ref,
                                                                      monkeypatch):
    """With HANDOFF_SYNC_GRAPH=1 the same device tensors loaded a second time are captured in
    a graph, a third time replayed: values changed in place since are what lands (tokens
    equal an engine that loaded them as launched)."""
    monkeypatch.setenv("HANDOFF_SYNC_GRAPH", "1")
    cfg = ref.cfg(num_blocks=1024, block_size=16, max_num_seqs=64)
    adapter = {k: v.to("cuda", torch.bfloat16) for k, v in _random_adapter(qwen3_dir).items()}
    engine = Engine(str(qwen3_dir), cfg, dtype="bfloat16", lora_max_rank=8)
    for _ in range(2):
        engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    assert engine.lora._plan.graph is not None
    before = _tokens(engine)
    for name, tensor in adapter.items():   # an optimizer step: the same tensors, new values
        if "lora_B" in name:
            tensor.mul_(-1)
    engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    monkeypatch.setenv("HANDOFF_SYNC_GRAPH", "0")
    launched = Engine(str(qwen3_dir), cfg, dtype="bfloat16", lora_max_rank=8)
    for _ in range(2):
        launched.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    assert launched.lora._plan.graph is None
    after = _tokens(engine)
    assert after == _tokens(launched) and after != before
