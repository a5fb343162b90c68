"""The engine's LoRA (rollout/lora.py) against transformers + peft on CPU (fp32, tiny models).

A PEFT adapter (r=4, alpha=8, all seven projections, B drawn non-zero: peft starts it at
zero) is saved with save_pretrained and its safetensors loaded into the engine: greedy
completions equal peft's `generate`, and the base model's once the adapter is cleared. The
base weights are never written, a reload copies in place, a bad adapter is refused before
anything is written, an engine without an adapter never runs adapter code, and a TP = 2
engine (two gloo processes) with the adapter gives what one process gives.
"""

from __future__ import annotations

import functools
import hashlib
import types
from pathlib import Path

import pytest
import torch

from handoff.errors import HandoffError
from handoff.rollout import lora
from handoff.rollout.engine import Engine
from handoff.rollout.sampling import SamplingParams

RANK, ALPHA = 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 9, [42]]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@functools.lru_cache(maxsize=2)
def _peft_model(model_dir: str):
    """(peft model with random non-zero A and B, its save_pretrained directory)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                            lora_dropout=0.0)).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 / param.shape[1] ** 0.5)
    adapter_dir = Path(model_dir).with_name(Path(model_dir).name + "-adapter")
    model.save_pretrained(str(adapter_dir))
    return model, adapter_dir


def _adapter(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(_peft_model(str(model_dir))[1] / "adapter_model.safetensors"))


@torch.no_grad()
def _peft_greedy(model_dir, prompt: list[int]) -> list[int]:
    model = _peft_model(str(model_dir))[0]
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                         do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


def _tokens(engine: Engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _base_checksum(engine: Engine) -> str:
    digest = hashlib.sha256()
    for param in engine.model.parameters():
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("which", ["qwen3_dir", "llama_dir"])
def test_greedy_with_adapter_matches_peft_and_clear_gives_the_base(which, ref, request):
    path = request.getfixturevalue(which)
    engine = Engine(str(path), ref.cfg())
    engine.load_adapter(_adapter(path), alpha=ALPHA, rank=RANK)
    with_adapter = _tokens(engine)
    assert with_adapter == [_peft_greedy(path, p) for p in PROMPTS]
    base = [ref.greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    assert with_adapter != base, "the adapter changes nothing: the test would prove nothing"
    engine.clear_adapter()
    assert _tokens(engine) == base


def test_reload_in_place_padded_rank_and_names_without_prefix(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg(), lora_max_rank=8)  # rank 4 in 8: zero padding
    base_sum = _base_checksum(engine)
    adapter = _adapter(qwen3_dir)
    engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    first = engine.generate(PROMPTS, GREEDY)
    buffers = [(s.A.data_ptr(), s.B.data_ptr()) for s in
               (m.lora for m in engine.lora.linears.values())]
    bare = {k.removeprefix("base_model.model."): v for k, v in adapter.items()}
    assert bare.keys() != adapter.keys()
    engine.load_adapter(iter(bare.items()), alpha=ALPHA, rank=RANK)  # pairs, as a sync sends
    again = engine.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert [o.outputs[0].logprobs for o in again] == [o.outputs[0].logprobs for o in first]
    assert [o.outputs[0].token_ids for o in first] == [_peft_greedy(qwen3_dir, p) for p in PROMPTS]
    assert buffers == [(s.A.data_ptr(), s.B.data_ptr()) for s in
                       (m.lora for m in engine.lora.linears.values())]
    engine.clear_adapter()
    assert _base_checksum(engine) == base_sum


def test_a_reload_zeroes_the_buffers_only_when_the_layout_changes(qwen3_dir, ref, monkeypatch):
    """The training loop syncs the same (rank, tensors) every step: those loads overwrite in
    place without zeroing first; a load of another rank or of fewer modules zeroes first, so
    nothing of the last adapter is left (outputs equal a fresh engine's)."""
    adapter = _adapter(qwen3_dir)
    gen = torch.Generator().manual_seed(3)

    def widened():   # a rank-8 adapter: the rank-4 one with four more random ranks
        return {k: torch.cat([v, torch.randn(v.shape, generator=gen) * 0.1],
                             dim=0 if "lora_A" in k else 1) for k, v in adapter.items()}

    wide, wide_again = widened(), widened()
    attn_only = {k: v for k, v in adapter.items() if "self_attn" in k}
    expected = {}
    for name, tensors, rank in (("wide_again", wide_again, 8), ("attn_only", attn_only, RANK)):
        fresh = Engine(str(qwen3_dir), ref.cfg(), lora_max_rank=8)
        fresh.load_adapter(tensors, alpha=ALPHA, rank=rank)
        expected[name] = _tokens(fresh)
    assert expected["wide_again"] != expected["attn_only"]
    clears = []
    clear = lora.LoraAdapters.clear
    monkeypatch.setattr(lora.LoraAdapters, "clear", lambda self: clears.append(1) or clear(self))
    engine = Engine(str(qwen3_dir), ref.cfg(), lora_max_rank=8)
    engine.load_adapter(wide, alpha=ALPHA, rank=8)
    engine.load_adapter(wide_again, alpha=ALPHA, rank=8)   # same layout: overwritten in place
    assert len(clears) == 1 and _tokens(engine) == expected["wide_again"]
    engine.load_adapter(attn_only, alpha=ALPHA, rank=RANK)   # fewer ranks and modules
    assert len(clears) == 2 and _tokens(engine) == expected["attn_only"]


def test_a_sync_of_the_same_layout_reuses_the_checked_destinations(qwen3_dir, ref, monkeypatch):
    """The training loop loads the same names every step: each tensor's destination is found
    and checked on the first load only; new values still land (outputs equal a fresh
    engine's), and a tensor of another shape under the same name is checked again."""
    adapter = _adapter(qwen3_dir)
    halved = {k: v * 0.5 for k, v in adapter.items()}
    fresh = Engine(str(qwen3_dir), ref.cfg())
    fresh.load_adapter(halved, alpha=ALPHA, rank=RANK)
    looked_up = []
    destination = lora.LoraAdapters._destination
    monkeypatch.setattr(lora.LoraAdapters, "_destination",
                        lambda self, *a: looked_up.append(1) or destination(self, *a))
    engine = Engine(str(qwen3_dir), ref.cfg())
    engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    assert len(looked_up) == len(adapter)
    engine.load_adapter(halved, alpha=ALPHA, rank=RANK)
    assert len(looked_up) == len(adapter) and _tokens(engine) == _tokens(fresh)
    name = next(iter(adapter))
    with pytest.raises(HandoffError, match="has shape"):
        engine.load_adapter({**halved, name: halved[name][:, :-1]}, alpha=ALPHA, rank=RANK)
    assert _tokens(engine) == _tokens(fresh)


def test_the_same_sources_twice_are_captured_then_replayed(qwen3_dir, ref, monkeypatch):
    """On CUDA (unless HANDOFF_SYNC_GRAPH=0) a load's writes go into a graph once the same
    source tensors come twice (a training loop's adapters stay put); loads from those sources
    replay it, values changed in place included; other sources are written as launched. On
    CPU: a stand-in graph that runs what it captured."""
    events = []

    class Graph:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            events.append("replay")
            self.fn()

    copy = lora.copy_in_batches
    monkeypatch.setattr(lora, "copy_in_batches", lambda c: events.append("write") or copy(c))
    monkeypatch.setattr(lora, "_sync_graphs", lambda dests: True)
    monkeypatch.setattr(lora, "capture_graph", lambda fn: events.append("capture") or Graph(fn))
    adapter = _adapter(qwen3_dir)
    engine = Engine(str(qwen3_dir), ref.cfg())
    for expected in (["write"], ["capture", "replay", "write"], ["replay", "write"]):
        events.clear()
        engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
        assert events == expected
    for tensor in adapter.values():   # an optimizer step: the same tensors, new values
        tensor.mul_(0.5)
    events.clear()
    engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    assert events == ["replay", "write"]
    fresh = Engine(str(qwen3_dir), ref.cfg())
    fresh.load_adapter({k: v.clone() for k, v in adapter.items()}, alpha=ALPHA, rank=RANK)
    assert _tokens(engine) == _tokens(fresh)
    copied = {k: v.clone() for k, v in adapter.items()}   # other sources: launched again
    events.clear()
    engine.load_adapter(copied, alpha=ALPHA, rank=RANK)
    assert events == ["write"]
    events.clear()
    engine.load_adapter(copied, alpha=ALPHA, rank=RANK)
    assert events == ["capture", "replay", "write"]


def test_the_sync_graph_is_cuda_only_and_on_unless_switched_off(monkeypatch):
    cuda, host = types.SimpleNamespace(is_cuda=True), types.SimpleNamespace(is_cuda=False)
    monkeypatch.delenv("HANDOFF_SYNC_GRAPH", raising=False)
    assert lora._sync_graphs([cuda]) and not lora._sync_graphs([host])
    monkeypatch.setenv("HANDOFF_SYNC_GRAPH", "0")
    assert not lora._sync_graphs([cuda])


def test_an_engine_without_adapter_never_runs_adapter_code(qwen3_dir, ref, monkeypatch):
    calls = []
    run = lora.LoraSlot.linear
    monkeypatch.setattr(lora.LoraSlot, "linear",
                        lambda self, *args, **kw: calls.append(1) or run(self, *args, **kw))
    engine = Engine(str(qwen3_dir), ref.cfg())
    assert _tokens(engine) == [ref.greedy(qwen3_dir, p, NEW_TOKENS) for p in PROMPTS]
    assert engine.lora is None and calls == []
    engine.load_adapter(_adapter(qwen3_dir), alpha=ALPHA, rank=RANK)
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))
    layers = engine.spec.num_layers
    assert len(calls) == 2 * 4 * layers  # prefill + one decode step, 4 engine linears a layer


def test_a_decode_steps_terms_go_to_the_reader_or_the_term_kernel(qwen3_dir, ref, monkeypatch):
    """ops.PendingTerm's path, taken on CPU by letting the fold's rule skip its device check
    (the readers then take the reference, which adds the term first): every layer's q/k/v
    and gate/up products of a forward of few rows come back pending, and o's and down's
    terms go to kernels/fused.add_term (here a counting addmm); the tokens are the
    expand's; HANDOFF_LORA_FOLD=0 turns both off."""
    pytest.importorskip("triton")
    from handoff.rollout import ops
    from handoff.rollout.kernels import fused
    from handoff.rollout.models.qwen3 import CausalLM

    engine = Engine(str(qwen3_dir), ref.cfg(), lora_max_rank=RANK)   # A joined: strided y
    engine.load_adapter(_adapter(qwen3_dir), alpha=ALPHA, rank=RANK)
    expanded = _tokens(engine)
    pending, materialized, term_kernel, forwards = [], [], [], []

    class Counted(ops.PendingTerm):
        def __init__(self, *args):
            super().__init__(*args)
            pending.append(self.y_TF.shape[0])

        def materialize(self):   # the CPU reference's reader adds the term first
            materialized.append(self.y_TF.shape[0])
            return super().materialize()

    forward = CausalLM.forward
    monkeypatch.setattr(CausalLM, "forward", lambda self, ids, *a: forwards.append(
        ids.shape[0]) or forward(self, ids, *a))

    def add_term(y, t, b):   # the term kernel, as addmm on these CPU tensors
        term_kernel.append(y.shape[0])
        return y.addmm_(t, b.t())

    monkeypatch.setattr(ops, "PendingTerm", Counted)
    monkeypatch.setattr(fused, "add_term", add_term)
    monkeypatch.setattr(ops, "term_in_triton", lambda x: ops.term_fold_allowed(x.shape[0]))
    monkeypatch.setattr(ops, "FOLD_MAX_ROWS", 8)   # the prefill's 45 rows expand as before

    def terms_per_folded_forward() -> tuple[float, float]:
        engine.reset_prefix_cache()
        for seen in (pending, materialized, term_kernel, forwards):
            seen.clear()
        assert _tokens(engine) == expanded
        folded = [rows for rows in forwards if rows <= 8]
        assert 0 < len(folded) < len(forwards)
        per_layer = len(folded) * engine.spec.num_layers
        # o's and down's: the kernel's calls but those of pending terms materialized
        alone = len(term_kernel) - len(materialized)
        return len(pending) / per_layer, alone / per_layer

    assert terms_per_folded_forward() == (2, 2)   # q/k/v and gate/up; o and down
    monkeypatch.setenv("HANDOFF_LORA_FOLD", "0")
    assert terms_per_folded_forward() == (0, 0)


def test_a_bad_adapter_is_refused_in_one_line_and_the_loaded_one_kept(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg())
    good = _adapter(qwen3_dir)
    garbled = {k.replace("lora_A", "lora_X"): v for k, v in good.items()}
    with pytest.raises(HandoffError, match="is not a LoRA weight"):
        engine.load_adapter(garbled, alpha=ALPHA, rank=RANK)
    assert engine.lora is None  # a refused first adapter leaves no adapter code behind
    assert all(m.lora is None for m in engine.model.modules() if hasattr(m, "lora"))
    engine.load_adapter(good, alpha=ALPHA, rank=RANK)
    before = _tokens(engine)
    name_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    name_b = name_a.replace("lora_A", "lora_B")
    bad = {
        "a shape": {**good, name_a: torch.zeros(RANK + 1, good[name_a].shape[1])},
        "an unknown module": {**good, "base_model.model.lm_head.lora_A.weight": good[name_a]},
        "a layer past the model": {**good, name_a.replace("layers.0", "layers.9"): good[name_a]},
        "a missing half": {k: v for k, v in good.items() if k != name_b},
    }
    for what, tensors in bad.items():
        with pytest.raises(HandoffError) as caught:
            engine.load_adapter(tensors, alpha=ALPHA, rank=RANK)
        assert "\n" not in str(caught.value), what
    with pytest.raises(HandoffError, match="lora_max_rank=8"):
        engine.load_adapter(good, alpha=ALPHA, rank=8)  # past the rank the buffers hold
    assert _tokens(engine) == before


def test_tp2_engine_with_adapter_matches_one_process(qwen3_dir, ref, tmp_path):
    import json

    from test_parallel_engine import HERE, torchrun

    import tp_lora_job as job

    adapter = _peft_model(str(qwen3_dir))[1] / "adapter_model.safetensors"
    torchrun([str(HERE / "tp_lora_job.py"), str(qwen3_dir), str(adapter), str(tmp_path)])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    alone = Engine(str(qwen3_dir), ref.cfg(**job.CFG))
    alone.load_adapter(_adapter(qwen3_dir), alpha=ALPHA, rank=RANK)
    with_adapter = job.tokens(alone)
    alone.clear_adapter()
    assert with_adapter != job.tokens(alone)
    for r in ranks:
        assert r["adapter"] == with_adapter
        assert r["cleared"] == job.tokens(alone)
        # Under TP the column-parallel products join A; the row-parallel ones keep it apart,
        # their partial term added before the all-reduce.
        assert r["joined"] == ["gate_up_proj"] * 2 + ["qkv_proj"] * 2


def test_an_engine_with_decode_graphs_needs_its_max_rank_up_front(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg())
    engine.runner.graphs = object()  # as on CUDA: graphs captured at start, without adapters
    with pytest.raises(HandoffError, match="lora_max_rank=4"):
        engine.load_adapter(_adapter(qwen3_dir), alpha=ALPHA, rank=RANK)
    assert engine.lora is None
    with pytest.raises(HandoffError, match="not positive"):
        Engine(str(qwen3_dir), ref.cfg(), lora_max_rank=0)


def test_a_linears_adapter_rows_follow_its_weight_and_one_gemm_gives_both(qwen3_dir, ref):
    from handoff.plan.lora import engine_adapter_rows
    from handoff.plan.shapes import load_shape
    from handoff.rollout import ops
    from handoff.rollout.layers import ColumnParallelLinear, RowParallelLinear, adapter_rows
    from handoff.rollout.parallel import TPGroup

    engine = Engine(str(qwen3_dir), ref.cfg(), lora_max_rank=RANK)
    engine.load_adapter(_adapter(qwen3_dir), alpha=ALPHA, rank=RANK)
    gen = torch.Generator().manual_seed(3)
    for name, module in engine.lora.linears.items():
        slot, weight = module.lora, module.weight
        assert slot.joined is not None and slot.joined.data_ptr() == weight.data_ptr(), name
        assert slot.A.data_ptr() == weight.data_ptr() + weight.numel() * weight.element_size()
        apart = lora.LoraSlot(weight, RANK)        # the same adapter in buffers of its own
        apart.A.copy_(slot.A)
        apart.B.copy_(slot.B)
        assert apart.joined is None and slot.A.abs().max() > 0
        x = torch.randn(3, weight.shape[1], generator=gen)
        torch.testing.assert_close(ops.linear(x, weight, None, slot),
                                   ops.linear(x, weight, None, apart))
    assert _tokens(engine) == [_peft_greedy(qwen3_dir, p) for p in PROMPTS]
    rows = sum(m.lora.A.numel() for m in engine.lora.linears.values())
    assert rows == engine_adapter_rows(load_shape(str(qwen3_dir)), RANK, tp=1)   # as planned
    # A decode step reads the adapter's A and B with the weights (the bench's HBM floor).
    from handoff.rollout.layers import shard_rules
    b_elements = sum(m.weight.shape[0] * len(shard_rules(m.weight)) * RANK
                     for m in engine.lora.linears.values())
    extra = engine.decode_weight_bytes - Engine(str(qwen3_dir), ref.cfg()).decode_weight_bytes
    assert extra == (rows + b_elements) * engine.model.model.norm.weight.element_size()
    # Where the GEMM's output must stay one dense tensor, A keeps a buffer of its own.
    meta = {"device": "meta", "dtype": torch.float32}
    fused = ColumnParallelLinear(8, [(6, 0, 6), (2, 0, 2), (2, 0, 2)], bias=False, **meta)
    assert adapter_rows(fused, 4) == 12
    assert adapter_rows(ColumnParallelLinear(8, [(6, 0, 6)], bias=True, **meta), 4) == 0
    assert adapter_rows(RowParallelLinear(8, 6, bias=False, tp=TPGroup(), **meta), 4) == 4
    assert adapter_rows(RowParallelLinear(8, 6, bias=False, tp=TPGroup(rank=0, size=2),
                                          **meta), 4) == 0


@pytest.mark.parametrize("preset,flags", [
    ("tiny-llama", {}), ("tiny-llama", {"attention_bias": True}),
    ("tiny-llama", {"mlp_bias": True}), ("tiny-qwen3", {"model_type": "qwen2"})])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_plan_counts_the_a_rows_the_engine_keeps_beside_its_weights(preset, flags, tp_size):
    """engine_adapter_rows reads the bias flags the engine builds from (a biased product keeps
    A apart), and TP's row-parallel linears."""
    from handoff.plan.lora import engine_adapter_rows
    from handoff.plan.shapes import PRESETS, shape_from_config
    from handoff.rollout.layers import adapter_rows
    from handoff.rollout.models import build_model, spec_from_hf_config
    from handoff.rollout.parallel import TPGroup

    cfg = {**PRESETS[preset], **flags}
    model = build_model(spec_from_hf_config(cfg), device=torch.device("cpu"),
                        dtype=torch.bfloat16, tp=TPGroup(rank=0, size=tp_size),
                        lora_max_rank=RANK)
    kept = sum(adapter_rows(m, RANK) * m.weight.shape[1] for name, m in model.named_modules()
               if name.startswith("model.layers.") and hasattr(m, "lora"))
    assert kept == engine_adapter_rows(shape_from_config(cfg), RANK, tp=tp_size)


def test_no_adapter_write_while_the_weights_sleep(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg(), lora_max_rank=RANK)
    adapter = _adapter(qwen3_dir)
    engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    engine.sleep(1)
    for call in (lambda: engine.load_adapter(adapter, alpha=ALPHA, rank=RANK),
                 engine.clear_adapter):
        with pytest.raises(HandoffError, match=r"wake_up\(\['weights'\]\) first"):
            call()
    engine.wake_up()
    engine.clear_adapter()
    assert _tokens(engine) == [ref.greedy(qwen3_dir, p, NEW_TOKENS) for p in PROMPTS]


def test_a_level_1_sleep_keeps_the_adapter_and_level_2_drops_it(qwen3_dir, ref):
    from handoff.rollout.models import iter_checkpoint

    engine = Engine(str(qwen3_dir), ref.cfg(), lora_max_rank=RANK)
    adapter = _adapter(qwen3_dir)
    engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    with_adapter = _tokens(engine)
    engine.sleep(1)
    engine.wake_up()
    assert _tokens(engine) == with_adapter
    engine.sleep(2)
    engine.wake_up()
    slots = [m.lora for m in engine.lora.linears.values()]
    assert all(not s.A.any() and not s.B.any() for s in slots)
    engine.load_weights(iter_checkpoint(qwen3_dir))
    assert _tokens(engine) == [ref.greedy(qwen3_dir, p, NEW_TOKENS) for p in PROMPTS]
    engine.load_adapter(adapter, alpha=ALPHA, rank=RANK)
    assert _tokens(engine) == with_adapter
