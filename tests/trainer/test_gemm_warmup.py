"""train.gemm_warmup: the GEMMs a forward of the model runs, launched once per process on
dummy operands (checked by the matrix products the profiler sees), and where the streamed
switch launches them: before the copies back are queued, with an off switch."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

import handoff.trainer.gemm_warmup as gemm_warmup
from handoff.modelzoo import init_model
from handoff.trainer.gemm_warmup import model_gemms, warm_gemms


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = init_model("tiny-qwen3", tmp_path_factory.mktemp("warm"), dtype="float32")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch):
    monkeypatch.setattr(gemm_warmup, "_launched", set())


def _linear_shapes(model) -> set[tuple[int, int]]:
    head = model.get_output_embeddings()
    return {(m.out_features, m.in_features) for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m is not head}


def _products(fn) -> list[tuple[int, int, int]]:
    """(rows, inner, cols) of every matrix product `fn` runs, as the profiler records them."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    out = []
    for e in prof.events():
        if e.name == "aten::mm":
            (m, k), (_, n) = e.input_shapes[:2]
            out.append((m, k, n))
    return out


def test_the_gemms_of_a_forward_are_every_linear_and_the_head_chunks(model):
    linears = _linear_shapes(model)
    assert len(linears) >= 4   # q, k/v, o, gate/up, down: the test sees several
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    gemms = model_gemms(model, [(1, 10), (2, 7), (1, 10)], chunk_tokens=8)
    # [1, 10] and [2, 7] (the repeat counted once): every Linear at those rows, and the head
    # at its chunks' rows (8 + 2 and 8 + 6).
    assert {(g[3], g[4]) for g in gemms if g[0] == "linear"} == linears
    assert len([g for g in gemms if g[0] == "linear"]) == 2 * len(linears)
    assert sorted(g[1] for g in gemms if g[0] == "head") == [2, 6, 8, 8]
    assert all(g[2:4] == (vocab, hidden) for g in gemms if g[0] == "head")
    # Without the chunked head the whole [b, w, V] logits are one more Linear.
    plain = model_gemms(model, [(2, 7)], chunk_tokens=0)
    assert ("linear", 2, 7, vocab, hidden, torch.float32, False) in plain


def test_each_shape_is_launched_once_per_process(model):
    cpu = torch.device("cpu")
    linears = _linear_shapes(model)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    launched = []
    products = _products(lambda: launched.append(
        warm_gemms(model, [(1, 10)], chunk_tokens=8, device=cpu)))
    assert launched == [len(linears) + 2]
    assert sorted(products) == sorted([(10, inp, out) for out, inp in linears]
                                      + [(8, hidden, vocab), (2, hidden, vocab)])
    # The same shapes again: nothing; a new row count: only its GEMMs.
    assert _products(lambda: launched.append(
        warm_gemms(model, [(1, 10)], chunk_tokens=8, device=cpu))) == []
    products = _products(lambda: launched.append(
        warm_gemms(model, [(1, 10), (1, 12)], chunk_tokens=8, device=cpu)))
    assert launched[1:] == [0, len(linears) + 1]   # 12 = 8 (launched) + 4
    assert sorted(products) == sorted([(12, inp, out) for out, inp in linears]
                                      + [(4, hidden, vocab)])


def test_backward_adds_each_linears_two_backward_gemms(model):
    linears = _linear_shapes(model)
    products = _products(lambda: warm_gemms(model, [(1, 5)], chunk_tokens=0,
                                            device=torch.device("cpu"), backward=True))
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    for out, inp in linears | {(vocab, hidden)}:
        assert (5, inp, out) in products                 # y = x W^T
        assert (5, out, inp) in products                 # dx = dy W
        assert (out, 5, inp) in products                 # dW = dy^T x
