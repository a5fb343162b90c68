"""CPU contract of RegionPool: levels, no-op sleeps, unknown tags, hooks, wake refusal."""


import pytest
import torch

from handoff.errors import HandoffError
from handoff.memory.regions import RegionPool


def _pool_with_model(tag="weights"):
    pool = RegionPool("cpu")
    with pool.region(tag):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
        model.register_buffer("table", torch.arange(32, dtype=torch.float32))
    pool.track(tag, model)
    return pool, model


def _nbytes(model):
    return [t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]]


def test_level2_frees_storage_and_keeps_tensor_objects():
    pool, model = _pool_with_model()
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    pool.sleep(["weights"], level=2)
    assert not pool.is_awake("weights")
    assert all(n == 0 for n in _nbytes(model))
    assert [p.shape for p in model.parameters()] == shapes
    assert all(a is b for a, b in zip(model.parameters(), params))
    pool.wake_up(["weights"])
    assert pool.is_awake("weights")
    assert _nbytes(model) == [t.numel() * t.element_size()
                              for t in [*model.parameters(), *model.buffers()]]


def test_level1_restores_exact_contents():
    pool, model = _pool_with_model()
    with torch.no_grad():
        model[0].weight.normal_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pool.sleep("weights", level=1)
    assert all(n == 0 for n in _nbytes(model))
    pool.wake_up("weights")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_level1_backs_up_every_view_of_a_shared_storage():
    """The engine's weights are views of one buffer: level 1 must keep all of it, not the
    first view that track() met."""
    pool = RegionPool("cpu")
    flat = torch.zeros(64, dtype=torch.float32)
    views = [flat[:16].view(4, 4), flat[16:48], flat[48:]]
    for i, v in enumerate(views):
        v.copy_(torch.arange(v.numel(), dtype=torch.float32).view(v.shape) + 100 * i)
    before = [v.clone() for v in views]
    pool.track("weights", views)
    assert pool.tracked_bytes("weights") == 64 * 4  # one storage, counted once
    pool.sleep("weights", level=1)
    assert pool.arena.set_bytes("region:weights") == 64 * 4  # the whole buffer went to host
    pool.wake_up("weights")
    for v, b in zip(views, before):
        assert torch.equal(v, b)


def test_region_bytes_is_tracked_storage_bytes():
    pool, model = _pool_with_model()
    expected = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert pool.region_bytes("weights") == expected
    pool.sleep(level=2)
    assert pool.region_bytes("weights") == expected  # what a wake must map


def test_sleep_asleep_and_wake_awake_are_noops():
    pool, model = _pool_with_model()
    calls = []
    pool.add_restore_hook("weights", lambda: calls.append(1))
    pool.wake_up()                      # awake already: no hook, nothing remapped
    assert calls == []
    with torch.no_grad():
        model[0].weight.fill_(3.0)
    pool.sleep(level=1)
    pool.sleep(level=2)                 # asleep already: must not drop the level-1 backup
    pool.wake_up()
    assert torch.all(model[0].weight == 3.0)
    assert calls == [1]


def test_unknown_tag_names_known_tags():
    pool, _ = _pool_with_model()
    with pytest.raises(HandoffError, match=r"unknown region tag 'kv'.*\['weights'\]"):
        pool.sleep(["kv"])
    with pytest.raises(HandoffError, match="known"):
        pool.wake_up("kv")
    with pytest.raises(HandoffError, match="known"):
        pool.is_awake("kv")
    with pytest.raises(HandoffError, match="known"):
        pool.add_restore_hook("kv", lambda: None)


def test_bad_level_and_level1_without_tracked_tensors():
    pool, _ = _pool_with_model()
    with pytest.raises(HandoffError, match="level=3"):
        pool.sleep(level=3)
    with pool.region("kv_cache"):
        pass
    pool.sleep("kv_cache", level=1)  # empty region: nothing to keep, allowed
    assert not pool.is_awake("kv_cache")


def test_restore_hooks_run_in_tag_then_registration_order():
    pool, _ = _pool_with_model("weights")
    kv = torch.zeros(64)
    pool.track("kv_cache", [kv])
    order = []
    pool.add_restore_hook("kv_cache", lambda: order.append("kv-zero"))
    pool.add_restore_hook("weights", lambda: order.append("w-buffers"))
    pool.add_restore_hook("kv_cache", lambda: order.append("kv-scales"))
    pool.sleep(level=2)
    pool.wake_up(["weights", "kv_cache"])
    assert order == ["w-buffers", "kv-zero", "kv-scales"]
    assert kv.untyped_storage().nbytes() == 64 * 4


def test_wake_that_cannot_fit_fails_before_mapping(monkeypatch):
    pool, model = _pool_with_model()
    pool.sleep(level=2)
    monkeypatch.setattr(pool._backend, "free_bytes", lambda: 1000)
    with pytest.raises(HandoffError, match=r"cannot wake \['weights'\].*needs.*free"):
        pool.wake_up()
    assert not pool.is_awake("weights")
    assert all(n == 0 for n in _nbytes(model))


def test_wake_failing_half_way_sleeps_again():
    pool, model = _pool_with_model("weights")
    kv = torch.ones(128)
    pool.track("kv_cache", [kv])
    with torch.no_grad():
        model[0].weight.fill_(7.0)
    pool.sleep("weights", level=1)
    pool.sleep("kv_cache", level=2)

    def broken():
        raise RuntimeError("fp8 scale reset failed")

    pool.add_restore_hook("kv_cache", broken)
    with pytest.raises(RuntimeError, match="fp8"):
        pool.wake_up()
    assert not pool.is_awake("weights") and not pool.is_awake("kv_cache")
    assert kv.untyped_storage().nbytes() == 0
    assert all(n == 0 for n in _nbytes(model))
    pool._hooks["kv_cache"].clear()
    pool.wake_up()                      # the level-1 backup survived the failed wake
    assert torch.all(model[0].weight == 7.0)


def test_region_of_sleeping_tag_and_track_wrong_device_are_errors():
    pool, _ = _pool_with_model()
    pool.sleep()
    with pytest.raises(HandoffError, match="asleep"):
        with pool.region("weights"):
            pass
    with pytest.raises(HandoffError, match="nn.Module or tensors"):
        pool.track("other", [1, 2])


def test_tied_weights_are_released_once_and_restored():
    pool = RegionPool("cpu")
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    pool.track("weights", model)
    assert pool.region_bytes("weights") == 10 * 4 * 4
    ref = emb.weight.detach().clone()
    pool.sleep(level=1)
    pool.wake_up()
    assert head.weight is emb.weight and torch.equal(emb.weight, ref)
