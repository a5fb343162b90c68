"""model.PassHooks: where a pass's hooks run. In a forward the first micro-batch of each input
shape new to the process is moved to the front and `first_launched` runs once those are
queued (at least one); the scores do not depend on the order. In an update it runs after the
first micro-batch's forward and backward."""

import pytest
import torch

import handoff.trainer.forward as forward_module
from handoff.config import ActorConfig
from handoff.modelzoo import init_model
from handoff.trainer.actor import Actor
from handoff.trainer.model import ShardedModel

from test_packing import long_tailed_batch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("hooks"), dtype="float32", seed=1))


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch):
    monkeypatch.setattr(forward_module, "_shapes_run", set())


class Recorder:
    """PassHooks that log, beside the forwards' input shapes, when each hook runs."""

    def __init__(self, log):
        self.log = log

    def inputs_ready(self, micro_batches):
        self.log.append(("inputs_ready", len(micro_batches)))

    def first_launched(self):
        self.log.append(("first_launched",))


def _logged(monkeypatch, module):
    log = []
    real = module.token_forward

    def forward(model, mb, **kwargs):
        log.append(("forward", tuple(mb.input_ids.shape)))
        return real(model, mb, **kwargs)

    monkeypatch.setattr(module, "token_forward", forward)
    return log


def test_new_shapes_go_first_and_the_hook_waits_for_them(ckpt, monkeypatch):
    import handoff.trainer.model as model_module

    ref = ShardedModel(ckpt, role="ref", device="cpu", dtype="float32", micro_batch_tokens=48)
    batch = long_tailed_batch()
    log = _logged(monkeypatch, model_module)
    plain, _ = ref.log_probs(batch, with_entropy=False)   # no hooks: the order as built
    built = [e[1] for e in log]
    forward_module._shapes_run.clear()
    log.clear()
    first, _ = ref.log_probs(batch, with_entropy=False, hooks=Recorder(log))
    shapes = [e[1] for e in log if e[0] == "forward"]
    assert len(shapes) >= 3 and len(set(shapes)) >= 2
    distinct = len(set(shapes))
    # Every shape is new: one of each, then the hook, then the repeats.
    assert log[0][0] == "inputs_ready"
    hook = log.index(("first_launched",))
    assert len(set(shapes[:distinct])) == distinct and hook == 1 + distinct
    assert torch.equal(first, plain)

    log.clear()
    again, _ = ref.log_probs(batch, with_entropy=False, hooks=Recorder(log))
    assert log.index(("first_launched",)) == 2    # nothing new: after the first one
    assert [e[1] for e in log if e[0] == "forward"] == built
    assert shapes != built    # the first call moved a shape forward
    assert torch.equal(again, plain)


def test_an_update_runs_the_hook_after_its_first_micro_batch(ckpt, monkeypatch):
    import handoff.trainer.actor as actor_module

    actor = Actor(ckpt, actor=ActorConfig(micro_batch_tokens=48), device="cpu", dtype="float32")
    log = _logged(monkeypatch, actor_module)
    actor.update(long_tailed_batch(), hooks=Recorder(log))
    assert log[0][0] == "inputs_ready" and log[2] == ("first_launched",)
    assert log[1][0] == "forward" and len([e for e in log if e[0] == "forward"]) >= 3
