"""The torch_memory_saver backend's bookkeeping, against a stand-in saver (runs on CPU).

The real thing runs in test_memory_cuda.py on the device; here we check what does not need a
GPU: per-pool tag prefixes, region bytes read from the tag's MemPool segments (and
refreshed after a new allocation), and the tracked-outside-region error.
"""

import contextlib

import pytest
import torch

from handoff.errors import HandoffError
from handoff.memory import tms_backend


class FakePool:
    def __init__(self, pool_id, segments):
        self.id = pool_id
        self.segments = segments

    def snapshot(self, include_traces=True):
        assert include_traces is False
        return [dict(s, segment_pool_id=self.id) for s in self.segments]


class FakeSaver:
    def __init__(self):
        self.calls = []
        self._impl = type("Impl", (), {"_mem_pools": {}})()

    @contextlib.contextmanager
    def region(self, tag):
        self.calls.append(("region", tag))
        yield

    def pause(self, tag):
        self.calls.append(("pause", tag))

    def resume(self, tag):
        self.calls.append(("resume", tag))


@pytest.fixture
def backends(monkeypatch):
    saver = FakeSaver()
    monkeypatch.setattr(tms_backend, "_saver", lambda: saver)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    dev = torch.device("cuda", 0)
    return saver, tms_backend.TmsBackend(dev), tms_backend.TmsBackend(dev)


def test_two_pools_never_share_a_saver_tag(backends):
    saver, a, b = backends
    with a.region("weights"):
        pass
    with b.region("weights"):
        pass
    a.release("weights", [])
    b.remap("weights", [], [])
    tags = [t for _, t in saver.calls]
    assert tags[0] != tags[1] and tags[0].endswith(":weights") and tags[1].endswith(":weights")
    assert saver.calls[2] == ("pause", tags[0]) and saver.calls[3] == ("resume", tags[1])


def test_region_bytes_from_the_tags_segments(backends):
    saver, a, b = backends
    pools = saver._impl._mem_pools
    seg = {"device": 0, "address": 1 << 40, "total_size": 64 << 20}
    pools[(a._prefix + "kv", False, False, "", 0)] = FakePool((1, 7), [seg])
    pools[(b._prefix + "kv", False, False, "", 0)] = FakePool((1, 8), [dict(seg, total_size=9)])
    pools[(a._prefix + "kv", False, False, "", 1)] = FakePool((1, 9), [dict(seg, device=1)])
    assert a.region_bytes("kv", 0) == 64 << 20
    pools[(a._prefix + "kv", False, False, "", 0)].segments.append(
        {"device": 0, "address": 1 << 41, "total_size": 2 << 20})
    assert a.region_bytes("kv", 0) == 64 << 20       # cached until the region grows
    with a.region("kv"):
        pass
    assert a.region_bytes("kv", 0) == 66 << 20


def test_tracked_tensor_outside_region_is_an_error(backends):
    saver, a, _ = backends
    t = torch.zeros(4)
    lo = t.untyped_storage().data_ptr()
    saver._impl._mem_pools[(a._prefix + "w", False, False, "", 0)] = FakePool(
        (1, 1), [{"device": 0, "address": lo, "total_size": 16}])
    a.check_tracked("w", t)                          # inside: fine
    with pytest.raises(HandoffError, match=r"not allocated inside pool.region\('w'\)"):
        a.check_tracked("w", torch.zeros(4))
