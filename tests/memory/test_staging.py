"""CPU contract of PinnedArena: bit-exact round trips, real frees, host space reuse."""

import pytest
import torch

from handoff.errors import HandoffError
from handoff.memory.staging import PinnedArena


def _model_and_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 16)).square().sum().backward()
    opt.step()
    return model, opt


def _opt_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("by_kernel", [False, True])   # on CPU both are plain copies
def test_params_and_optimizer_state_round_trip_bit_exact(by_kernel):
    model, opt = _model_and_adam()
    tensors = [*model.parameters(), *_opt_tensors(opt)]
    ref = [t.detach().clone() for t in tensors]
    arena = PinnedArena(chunk_bytes=100)  # tiny chunks: many pieces per storage
    arena.stage("train", tensors)
    t = arena.offload("train")
    t.wait()
    assert t.bytes == sum(r.numel() * r.element_size() for r in ref)
    assert all(x.untyped_storage().nbytes() == 0 for x in tensors)
    with pytest.raises(HandoffError, match="already offloaded"):
        arena.offload("train")
    assert all(x.numel() > 0 for x in tensors)  # shapes kept while the storage is gone
    arena.onload("train", by_kernel=by_kernel).wait()
    for x, r in zip(tensors, ref):
        assert torch.equal(x, r) and x.dtype == r.dtype
    # the optimizer still steps on the restored state
    model(torch.randn(3, 16)).sum().backward()
    opt.step()


def test_offload_without_free_keeps_device_copy():
    x = torch.randn(1000)
    arena = PinnedArena()
    arena.stage("x", [x])
    arena.offload("x", free_device=False).wait()
    assert x.untyped_storage().nbytes() == 4000
    kept = x.clone()
    x.zero_()
    arena.onload("x").wait()        # the host copy is what came back
    assert torch.equal(x, kept)


def test_host_space_reserved_once_and_reused():
    arena = PinnedArena()
    a, b = torch.randn(256), torch.randn(128)
    arena.stage("s", [a])
    reserved = arena.bytes_staged()
    arena.stage("s", [b])                   # smaller set: same host buffer
    assert arena.bytes_staged() == reserved
    arena.stage("s", [torch.randn(4096)])   # larger: grows
    assert arena.bytes_staged() > reserved


def test_shared_storage_views_move_once():
    base = torch.arange(100, dtype=torch.float32)
    v1, v2 = base[:50], base[50:].view(5, 10)
    arena = PinnedArena()
    arena.stage("views", [v1, v2, base])
    assert arena.set_bytes("views") == 400
    arena.offload("views")
    assert base.untyped_storage().nbytes() == 0
    arena.onload("views")
    assert torch.equal(v2.flatten(), torch.arange(50, 100, dtype=torch.float32))


def test_full_duplex_sets_interleave_on_cpu():
    arena = PinnedArena(chunk_bytes=64)
    a, b = torch.randn(500), torch.randn(700)
    ra, rb = a.clone(), b.clone()
    arena.stage("a", [a])
    arena.stage("b", [b])
    arena.offload("b").wait()
    t_down, t_up = arena.offload("a"), arena.onload("b")
    for t in (t_down, t_up):
        t.wait()
        assert t.seconds >= 0 and t.bytes > 0
    arena.onload("a").wait()
    assert torch.equal(a, ra) and torch.equal(b, rb)


def test_errors_name_cause_and_fix():
    arena = PinnedArena()
    with pytest.raises(HandoffError, match="no staged set 'x'"):
        arena.offload("x")
    arena.stage("x", [torch.ones(3)])
    arena.offload("x")
    with pytest.raises(HandoffError, match="already offloaded"):
        arena.offload("x")
    with pytest.raises(HandoffError, match="onload it"):
        arena.stage("x", [torch.ones(3)])
    with pytest.raises(HandoffError, match="chunk_bytes"):
        PinnedArena(chunk_bytes=0)


def test_dtensor_like_stands_for_its_local_shard():
    class Sharded:  # the one DTensor method the arena relies on
        def __init__(self, local):
            self.local = local

        def to_local(self):
            return self.local

    shard = torch.randn(64)
    ref = shard.clone()
    arena = PinnedArena()
    arena.stage("fsdp", [Sharded(shard)])
    arena.offload("fsdp")
    assert shard.untyped_storage().nbytes() == 0
    arena.onload("fsdp")
    assert torch.equal(shard, ref)


def test_drop_frees_without_a_copy_and_the_host_copy_comes_back():
    """A frozen set (the ref) is copied to the host once; later its device copy is dropped
    (0 bytes moved) and the next onload restores the values of that first copy."""
    model, _ = _model_and_adam()
    tensors = list(model.parameters())
    ref = [t.detach().clone() for t in tensors]
    arena = PinnedArena()
    arena.stage("ref", tensors)
    with pytest.raises(HandoffError, match="no host copy"):
        arena.drop("ref", tensors)   # nothing on the host yet: dropping would lose the values
    arena.offload("ref").wait()
    for _ in range(2):
        arena.onload("ref").wait()
        assert all(torch.equal(x, r) for x, r in zip(tensors, ref))
        dropped = arena.drop("ref", tensors)
        assert dropped.done() and dropped.bytes == 0 and dropped.seconds >= 0
        assert all(x.untyped_storage().nbytes() == 0 for x in tensors)
    with pytest.raises(HandoffError, match="already offloaded"):
        arena.drop("ref", tensors)
    arena.onload("ref").wait()
    assert all(torch.equal(x, r) for x, r in zip(tensors, ref))
    with pytest.raises(HandoffError, match="no longer the staged ones"):
        arena.drop("ref", [t.clone() for t in tensors])   # the owner swapped its storage
    arena.stage("ref", tensors)   # a new binding: its host space no longer counts as a copy
    with pytest.raises(HandoffError, match="no host copy"):
        arena.drop("ref", tensors)
