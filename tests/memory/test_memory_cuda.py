"""CUDA contract of handoff.memory (run on the device; skipped without a GPU).

Needs torch_memory_saver 0.0.10 on the path. Every pool is put to sleep at teardown: the
torch_memory_saver pools live as long as the process, so an awake leftover would hold its
pages for the rest of the session.
"""

import os
import subprocess
import sys

import pytest
import torch

from handoff.errors import HandoffError
from handoff.memory.meter import MemoryMeter
from handoff.memory.staging import PinnedArena
from handoff.memory.regions import RegionPool
from handoff.memory.allocator import aggressive_empty_cache

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB, GiB = 1 << 20, 1 << 30
SLACK = 4 * MiB  # the driver may round a mapping to its granularity


@pytest.fixture
def pool():
    aggressive_empty_cache()
    p = RegionPool("cuda")
    yield p
    p.sleep(level=2)
    aggressive_empty_cache()


def _driver_free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_addresses_unchanged_across_sleep_wake(pool):
    with pool.region("weights"):
        w = torch.randn(4096, 4096, device="cuda")
        b = torch.zeros(4096, device="cuda")
    pool.track("weights", [w, b])
    ptrs = (w.data_ptr(), b.data_ptr())
    for level in (2, 1, 2):
        pool.sleep(level=level)
        assert not pool.is_awake("weights")
        pool.wake_up()
        assert (w.data_ptr(), b.data_ptr()) == ptrs


def test_cuda_graph_replays_after_wake_with_new_weights(pool):
    with pool.region("weights"):
        w = torch.randn(1024, 1024, device="cuda")
    with pool.region("kv_cache"):
        x = torch.randn(64, 1024, device="cuda")
    pool.track("weights", [w])
    pool.track("kv_cache", [x])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x @ w  # warm up cuBLAS outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x @ w
    pool.sleep(level=2)
    pool.wake_up(["weights"])
    w_new = torch.randn(1024, 1024, device="cuda")
    w.copy_(w_new)
    pool.wake_up(["kv_cache"])
    x_new = torch.randn(64, 1024, device="cuda")
    x.copy_(x_new)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x_new @ w_new)


def test_freed_bytes_equal_region_bytes_per_driver(pool):
    with pool.region("kv_cache"):
        kv = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    pool.track("kv_cache", [kv])
    region = pool.region_bytes("kv_cache")
    assert 2 * GiB <= region <= 2 * GiB + SLACK
    free_awake = _driver_free()
    pool.sleep("kv_cache")
    free_asleep = _driver_free()
    assert abs((free_asleep - free_awake) - region) <= SLACK
    pool.wake_up("kv_cache")
    assert abs(_driver_free() - free_awake) <= SLACK


def test_region_bytes_are_counted_in_torch_reserved(pool):
    before = torch.cuda.memory_reserved()
    with pool.region("weights"):
        w = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    pool.track("weights", [w])
    assert torch.cuda.memory_reserved() - before == pool.region_bytes("weights")


def test_level1_round_trip_bit_exact(pool):
    torch.manual_seed(0)
    with pool.region("weights"):
        w = torch.randn(64 * MiB, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(-2**31, 2**31 - 1, (1 << 20,), device="cuda", dtype=torch.int32)
    pool.track("weights", [w, ids])
    ref_w, ref_ids = w.cpu(), ids.cpu()
    pool.sleep(level=1)
    # reuse the released pages for garbage, so stale contents cannot pass for a restore
    junk = torch.full((w.numel() * 2 + ids.numel() * 4,), 0x5A, dtype=torch.uint8,
                      device="cuda")
    del junk
    aggressive_empty_cache()
    pool.wake_up()
    assert torch.equal(w.cpu(), ref_w) and torch.equal(ids.cpu(), ref_ids)


def test_hundred_cycles_do_not_grow_reserved_or_driver_used(pool):
    with pool.region("weights"):
        w = torch.randn(128 * MiB, device="cuda")
    with pool.region("kv_cache"):
        kv = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    pool.track("weights", [w])
    pool.track("kv_cache", [kv])
    pool.sleep(level=1)
    pool.wake_up()  # first cycle pins the arena's host space
    reserved0, free0 = torch.cuda.memory_reserved(), _driver_free()
    pinned0 = pool.arena.bytes_staged()
    for i in range(100):
        pool.sleep(["weights"], level=1 if i % 10 == 0 else 2)
        pool.sleep(["kv_cache"], level=2)
        pool.wake_up(["weights", "kv_cache"])
    assert torch.cuda.memory_reserved() == reserved0
    assert abs(_driver_free() - free0) <= SLACK
    assert pool.arena.bytes_staged() == pinned0


def test_wake_that_cannot_fit_fails_before_mapping(pool):
    meter = MemoryMeter("cuda", pool=pool)
    pool.meter = meter
    with pool.region("kv_cache"):
        kv = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    pool.track("kv_cache", [kv])
    pool.sleep()
    aggressive_empty_cache()
    hog = torch.empty(_driver_free() - 2 * GiB, dtype=torch.uint8, device="cuda")
    meter.probe("trainer holds the card")
    free_before = _driver_free()
    with pytest.raises(HandoffError, match=r"cannot wake \['kv_cache'\].*trainer holds"):
        pool.wake_up()
    assert not pool.is_awake("kv_cache")
    assert abs(_driver_free() - free_before) <= SLACK
    del hog
    aggressive_empty_cache()
    pool.wake_up()
    assert pool.is_awake("kv_cache")


def test_arena_round_trip_frees_and_overlaps():
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 2048, device="cuda")).sum().backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if v.is_cuda]
    params = list(model.parameters())
    ref = [t.detach().cpu() for t in [*params, *state]]
    arena = PinnedArena(chunk_bytes=4 * MiB)
    arena.stage("params", params)
    arena.stage("optim", state)
    arena.offload("optim").wait()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    assert all(t.untyped_storage().nbytes() == 0 for t in state)
    down, up = arena.offload("params"), arena.onload("optim")   # both directions at once
    up.wait()
    down.wait()
    assert down.seconds > 0 and up.seconds > 0 and down.bytes == arena.set_bytes("params")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated - down.bytes + up.bytes
    arena.onload("params", by_kernel=True).wait()   # the way back after the engine's sleep
    for t, r in zip([*params, *state], ref):
        assert torch.equal(t.detach().cpu(), r)
    arena.close()


def test_offload_frees_at_wait_and_a_quick_onload_waits_for_the_way_out():
    """No record_stream (its per-storage events slow the next allocation): an offload's
    device memory stays allocated while the copy reads it and is freed at the wait; an
    onload issued before that wait first lets the way out land, then restores exactly."""
    torch.manual_seed(0)
    xs = [torch.randn(n, device="cuda") for n in (16 * MiB, 3 * MiB, 5)]
    ref = [x.cpu() for x in xs]
    arena = PinnedArena(chunk_bytes=4 * MiB)
    arena.stage("x", xs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    down = arena.offload("x")
    assert torch.cuda.memory_allocated() == before
    assert all(x.untyped_storage().nbytes() > 0 for x in xs)
    down.wait()
    freed = before - torch.cuda.memory_allocated()   # blocks round up to 512 bytes
    assert down.bytes <= freed < down.bytes + len(xs) * 512
    assert all(x.untyped_storage().nbytes() == 0 for x in xs)
    arena.onload("x").wait()
    arena.offload("x")
    arena.onload("x").wait()   # the offload was never waited on
    for x, r in zip(xs, ref):
        assert torch.equal(x.cpu(), r)
    arena.close()


def test_done_asks_without_blocking_and_drop_frees_at_once():
    """The streamed switch asks a copy in flight whether it landed between engine steps:
    done() is False until it has; a dropped set's memory is freed at the call, no copy, and
    the next onload brings back its host copy."""
    torch.manual_seed(0)
    xs = [torch.randn(64 * MiB, device="cuda"), torch.randn(5, device="cuda")]
    ref = [x.cpu() for x in xs]
    arena = PinnedArena(chunk_bytes=4 * MiB)
    arena.stage("x", xs)
    torch.cuda._sleep(200_000_000)   # the compute stream busy: the copy waits behind it
    down = arena.offload("x")
    assert not down.done()
    down.wait()
    assert down.done()
    arena.onload("x").wait()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    dropped = arena.drop("x", xs)
    assert dropped.done() and dropped.bytes == 0
    assert arena.set_bytes("x") <= before - torch.cuda.memory_allocated()
    assert all(x.untyped_storage().nbytes() == 0 for x in xs)
    arena.onload("x").wait()
    for x, r in zip(xs, ref):
        assert torch.equal(x.cpu(), r)
    arena.close()


def test_expandable_segments_in_environment_is_handled():
    code = ("import torch; from handoff.memory.regions import RegionPool\n"
            "x = torch.ones(1 << 20, device='cuda')\n"
            "p = RegionPool('cuda')\n"
            "with p.region('w'):\n    w = torch.ones(1 << 24, device='cuda')\n"
            "p.track('w', [w]); p.sleep(level=1); p.wake_up()\n"
            "assert bool((w == 1).all()); print('ok')\n")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
