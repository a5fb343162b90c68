"""RolloutBatch construction and the fp32-master AdamW against torch.optim.AdamW."""

import pytest
import torch

from handoff.errors import HandoffError
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.optim import MixedPrecisionAdamW


def test_from_tokens_right_pads_and_marks_responses():
    b = RolloutBatch.from_tokens([[1, 2], [1, 2, 3]], [[7], [8, 9]], [1.0, 0.0],
                                 group_size=2, pad_id=99)
    assert b.input_ids.tolist() == [[1, 2, 7, 99, 99], [1, 2, 3, 8, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b.response_mask.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 1]]
    assert int(b.response_mask.sum()) == 3 and len(b) == 2
    half = b.rows(1, 2)
    assert half.input_ids.tolist() == [[1, 2, 3, 8, 9]] and half.group_size == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[]], responses=[[1]], rewards=[0.0], group_size=1), "empty prompt"),
    (dict(prompts=[[1]], responses=[[1]], rewards=[0.0, 1.0], group_size=1), "rewards"),
    (dict(prompts=[[1]] * 3, responses=[[1]] * 3, rewards=[0.0] * 3, group_size=2), "groups"),
])
def test_from_tokens_rejects_bad_input(kwargs, match):
    with pytest.raises(HandoffError, match=match):
        RolloutBatch.from_tokens(pad_id=0, **kwargs)


def test_left_padding_is_rejected():
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(HandoffError, match="right-padded"):
        RolloutBatch(ids, torch.tensor([[0, 1, 1]]), torch.zeros(1, 3), torch.zeros(1), 1)


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(7, generator=g).to(dtype))]


def test_fp32_params_match_torch_adamw_and_hold_8_bytes_per_param():
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = MixedPrecisionAdamW([("a", ours[0]), ("b", ours[1])], lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=0.05, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for p, q in zip(ours, ref):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-6)
        assert p.grad is None
    assert opt.nbytes() == 22 * 8 and set(opt.state["a"]) == {"exp_avg", "exp_avg_sq"}


def test_bf16_params_step_an_fp32_master_and_hold_12_bytes_per_param():
    ours, ref = _params(torch.bfloat16), [p.float() for p in _params(torch.bfloat16)]
    ref = [torch.nn.Parameter(p) for p in ref]
    opt = MixedPrecisionAdamW([("a", ours[0]), ("b", ours[1])], lr=1e-3)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        for p, q in zip(ours, ref):
            q.grad = torch.randn(p.shape, generator=g).bfloat16().float()
            p.grad = q.grad.bfloat16()
        opt.step(grad_scale=0.5)
        for q in ref:
            q.grad.mul_(0.5)
        ref_opt.step()
    for name, p, q in zip("ab", ours, ref):
        master = opt.state[name]["master"]
        # 1e-3 steps are below bf16 resolution: only an fp32 master accumulates them
        assert torch.allclose(master, q.detach(), atol=1e-6)
        assert torch.equal(p.detach(), master.bfloat16())
    assert opt.nbytes() == 22 * 12


def test_the_optimizer_state_is_one_storage_its_tensors_apart():
    """The state moves as one storage (one allocation and a few large copies per switch):
    every tensor a view of `flat`, none overlapping another."""
    params = _params(torch.bfloat16)
    opt = MixedPrecisionAdamW([("a", params[0]), ("b", params[1])], lr=1e-3)
    tensors = list(opt.tensors().values())
    assert {t.untyped_storage()._cdata for t in tensors} == {opt.flat.untyped_storage()._cdata}
    spans = sorted((t.storage_offset(), t.storage_offset() + t.numel()) for t in tensors)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] == opt.flat.numel() == 22 * 3
    assert torch.equal(opt.state["a"]["master"], params[0].detach().float())
