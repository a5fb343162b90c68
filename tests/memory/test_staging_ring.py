"""The pinned ring behind host_copy.upload: a span is handed out only once every span it
overlaps has been waited for, oldest first (CPU: the ring's bookkeeping, fake events)."""

import collections
import random

import torch

from handoff.memory.host_copy import _Staging


class FakeEvent:
    def __init__(self, log, span):
        self.log, self.span = log, span

    def synchronize(self):
        self.log.append(self.span)


def _ring(nbytes):
    ring = _Staging.__new__(_Staging)
    ring.buf = torch.empty(nbytes, dtype=torch.uint8)
    ring.head, ring.busy = 0, collections.deque()
    return ring


def test_spans_never_overlap_one_still_in_use_and_are_waited_for_in_order():
    rng = random.Random(0)
    ring, waited = _ring(1024), []
    order = []   # spans in the order they were handed out
    for i in range(2000):
        n = rng.choice([64, 128, 192, 448, 1024])
        at = ring._reserve(n)
        assert 0 <= at and at + n <= 1024
        live = order[len(waited):]   # waited for oldest first (asserted below)
        assert all(b <= at or at + n <= a for _, a, b in live), (at, n, live)
        span = (i, at, at + n)
        order.append(span)
        ring.busy.append((at, FakeEvent(waited, span)))
        ring.head = at + n
        # oldest first: the spans were waited for in the order they were handed out
        assert waited == order[:len(waited)]
    assert len(waited) > 1500   # the ring really wrapped
