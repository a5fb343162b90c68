"""CPU contract of the elastic region (memory/elastic.py) on a simulated device, and of
RegionPool's elastic tags: map what is free less the margin, grow, release all, refuse a wake
that cannot hold the minimum before mapping anything."""

import pytest
import torch

from handoff.errors import HandoffError
from handoff.memory.elastic import ElasticArena, SimulatedDevice
from handoff.memory.regions import RegionPool

KiB = 1024


def _arena(capacity=1 << 30, others=0, slabs=4, slab_bytes=64 * KiB):
    sim = SimulatedDevice(capacity=capacity, others=others, granule=4 * KiB)
    return ElasticArena("cpu", slabs=slabs, slab_bytes=slab_bytes, simulated=sim), sim


def test_grow_maps_every_slab_front_in_granules_and_never_shrinks():
    arena, sim = _arena()
    assert arena.grow_to(5 * KiB) == 8 * KiB            # rounded up to two granules
    assert arena.mapped_bytes == 4 * 8 * KiB
    assert arena.free_bytes() == sim.capacity - 32 * KiB
    assert arena.grow_to(4 * KiB) == 8 * KiB            # never shrinks
    assert arena.grow_to(1 << 20) == 64 * KiB           # capped at the slab
    arena.release()
    assert arena.mapped_bytes == 0 and arena.free_bytes() == sim.capacity


def test_grow_past_free_memory_is_refused_and_maps_nothing():
    arena, sim = _arena(capacity=40 * KiB)
    with pytest.raises(HandoffError, match="cannot map .* more of the elastic pool"):
        arena.grow_to(16 * KiB)                          # 4 slabs x 16 KiB > 40 KiB
    assert arena.mapped_bytes == 0


def test_view_is_the_whole_range_and_keeps_its_address():
    arena, _ = _arena()
    arena.grow_to(4 * KiB)
    view = arena.view(torch.float32, (4, 64 * KiB // 4))
    ptr = view.data_ptr()
    arena.release()
    arena.grow_to(12 * KiB)
    assert arena.view(torch.float32, (4, 64 * KiB // 4)).data_ptr() == ptr
    with pytest.raises(HandoffError, match="is not the arena's"):
        arena.view(torch.float32, (4, 10))


def test_slab_must_be_whole_granules():
    with pytest.raises(HandoffError, match="multiple of the 4096-byte granule"):
        _arena(slab_bytes=6 * KiB)


def _elastic_pool(capacity, others=0, margin=0, keep=0, min_per_slab=8 * KiB):
    arena, sim = _arena(capacity=capacity, others=others)
    pool = RegionPool("cpu", wake_margin_bytes=margin)
    pool.elastic("kv", arena, min_per_slab=min_per_slab, keep_free_bytes=keep)
    return pool, arena, sim


def test_pool_maps_what_is_free_less_margin_and_grows_as_memory_frees():
    pool, arena, sim = _elastic_pool(capacity=200 * KiB, others=100 * KiB, margin=16 * KiB,
                                     keep=16 * KiB)
    # 200 - 100 held by others - 32 kept = 68 KiB -> 17 KiB a slab -> 16 KiB (granules)
    assert arena.mapped_per_slab == 16 * KiB
    assert pool.region_bytes("kv") == 64 * KiB
    sim.others = 0                                      # the trainer's copies landed
    assert pool.grow("kv") == 4 * 40 * KiB              # (200 - 64 - 32) / 4 = 26 -> +24
    pool.sleep(["kv"], level=2)
    assert not pool.is_awake("kv") and pool.region_bytes("kv") == 0
    assert pool.grow("kv") == 0                         # asleep: nothing to grow
    pool.wake_up(["kv"])
    assert arena.mapped_per_slab == 40 * KiB


def test_wake_with_less_free_maps_less_instead_of_failing():
    pool, arena, sim = _elastic_pool(capacity=400 * KiB)
    full = pool.region_bytes("kv")
    pool.sleep(["kv"])
    sim.others = 300 * KiB                              # something else took memory
    pool.wake_up(["kv"])
    assert 0 < pool.region_bytes("kv") < full


def test_wake_that_cannot_hold_the_minimum_fails_before_mapping():
    pool, arena, sim = _elastic_pool(capacity=400 * KiB, min_per_slab=32 * KiB)
    pool.sleep(["kv"])
    sim.others = 350 * KiB
    with pytest.raises(HandoffError, match=r"cannot wake \['kv'\]"):
        pool.wake_up(["kv"])
    assert not pool.is_awake("kv") and arena.mapped_bytes == 0


def test_elastic_tag_cannot_be_tracked_region():
    pool = RegionPool("cpu")
    pool.track("kv", [torch.zeros(4)])
    arena, _ = _arena()
    with pytest.raises(HandoffError, match="already holds memory"):
        pool.elastic("kv", arena, min_per_slab=4 * KiB)
    with pytest.raises(HandoffError, match="is not elastic"):
        pool.grow("kv")


def test_cuda_without_cuda_bindings_names_the_install(monkeypatch):
    import builtins

    from handoff.memory import elastic

    real_import = builtins.__import__

    def no_bindings(name, *args, **kwargs):
        if name.startswith("cuda.bindings") or name == "cuda":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bindings)
    with pytest.raises(HandoffError, match=r"pip install 'handoff\[elastic\]'.*kv_pool=fixed"):
        elastic.ElasticArena(torch.device("cuda", 0), slabs=2, slab_bytes=2 << 20)
