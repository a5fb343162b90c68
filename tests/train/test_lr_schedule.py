"""actor.lr_schedule: the learning rate of every optimizer step, by hand and beside torch's
own schedulers, and a resume that continues the sequence and the weights exactly."""

import math

import pytest
import torch

from handoff.config import ActorConfig
from handoff.modelzoo import init_model
from handoff.train.actor import Actor
from handoff.train.checkpoint import load_checkpoint, save_checkpoint
from handoff.train.optim import LrSchedule

from test_actor import make_batch


def _lrs(kind, warmup, total, base=1.0):
    schedule = LrSchedule(base, kind=kind, warmup_steps=warmup, total_steps=total)
    return [schedule.lr_at(k) for k in range(1, total + 1)]


@pytest.mark.parametrize("kind, want", [
    # warm-up over 2 steps: 1/2, 2/2; then the 4 steps 3..6 decay with p = (k - 3) / 4
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),                  # 1 - p
    ("cosine", [0.5, 1.0, 1.0, (1 + math.sqrt(0.5)) / 2, 0.5,      # (1 + cos(pi p)) / 2
                (1 - math.sqrt(0.5)) / 2]),
])
def test_each_schedule_by_hand(kind, want):
    assert _lrs(kind, 2, 6) == pytest.approx(want, abs=1e-12)


def test_no_warmup_starts_at_the_full_rate_and_scales_with_it():
    assert _lrs("constant", 0, 3, base=0.1) == [0.1, 0.1, 0.1]
    assert _lrs("linear", 0, 4, base=0.1) == pytest.approx([0.1, 0.075, 0.05, 0.025])
    with pytest.raises(ValueError, match="total_steps"):
        LrSchedule(0.1, kind="cosine")


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_the_values_are_torchs_sequential_warmup_then_decay(kind):
    warmup, total = 3, 10
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    decay = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup)
             if kind == "cosine" else
             torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0,
                                               total_iters=total - warmup))
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup - 1)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[warmup])
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])   # the rate this optimizer step uses
        opt.step()
        sched.step()
    assert _lrs(kind, warmup, total, base=0.5) == pytest.approx(theirs, abs=1e-12)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("lr"), dtype="float32"))


def _actor(ckpt):
    cfg = ActorConfig(lr=1e-2, lr_schedule="cosine", warmup_steps=1, updates_per_step=2)
    return Actor(ckpt, actor=cfg, dtype="float32", total_updates=6)


def test_a_resume_continues_the_lr_sequence_and_the_weights_exactly(ckpt, tmp_path):
    seeds = (11, 12, 13)   # 3 steps x 2 updates = 6; fresh batches per run (update fills them)
    whole = _actor(ckpt)
    whole_lrs = [whole.update(make_batch(seed=s))["actor/lr"] for s in seeds]
    # each step's actor/lr is the mean of its two updates' rates
    assert whole_lrs == pytest.approx([(a + b) / 2 for a, b in zip(*[iter(_lrs(
        "cosine", 1, 6, base=1e-2))] * 2)])

    first = _actor(ckpt)
    lrs = [first.update(make_batch(seed=seeds[0]))["actor/lr"]]
    save_checkpoint(tmp_path, first, step=1)
    resumed = _actor(ckpt)
    assert load_checkpoint(tmp_path, resumed)["step"] == 1
    lrs += [resumed.update(make_batch(seed=s))["actor/lr"] for s in seeds[1:]]
    assert lrs == whole_lrs
    for a, b in zip(resumed.part_tensors("params"), whole.part_tensors("params")):
        assert torch.equal(a, b)
