"""The step's clock: which of a step's seconds are work (generation, the trainer's compute)
and which are the switch's, read back as one frozen record.

    clock.begin()
    clock.compute("update", fn)         # fn's wall time less its waits for copies and the
                                        # compute's idle time while the host queued copies
    clock.flush()                       # an empty-cache in the switch: exposed host work
    times = clock.times()               # StepTimes

A step's exposed switch time is its wall time less the checkpoint and `StepTimes.work`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from handoff.dist import ComputeGap, wait_for_compute
from handoff.memory.allocator import aggressive_empty_cache, alloc_retries

T = TypeVar("T")


@dataclass(frozen=True)
class StepTimes:
    """A step's clock, read at its end.

    work: generation and trainer compute seconds by phase, less their waits for copies;
    copy_wait_s: the compute's waits for copies; flush_s: the switch's cache flushes (a
    device sync and the allocator's frees each); queue_s: the compute's idle time while the
    host queued the copies back inside it, and the GEMM warm-up's host time; gemms_warmed:
    the GEMM shapes launched before those copies; alloc_retries: allocations that flushed
    torch's cache (a device sync each: the step ran short). All but `work` are exposed."""

    work: dict[str, float]
    copy_wait_s: float
    flush_s: float
    queue_s: float
    gemms_warmed: int
    alloc_retries: int

    @property
    def work_s(self) -> float:
        return sum(self.work.values())


class StepClock:
    """One device's step clock. `copy_waits()` reads the trainer models' cumulative seconds
    spent waiting for copies (their own counters)."""

    def __init__(self, device: torch.device, copy_waits: Callable[[], float]):
        self.device = device
        self._copy_waits = copy_waits
        self.begin()

    def begin(self) -> None:
        self._work: dict[str, float] = {}
        self._copy_wait = self._flush = self._queue = 0.0
        self._gemms_warmed = 0
        self._queue_gaps: list[tuple[ComputeGap, float]] = []   # (gap, copy waits inside it)
        self._retries = alloc_retries(self.device)

    def times(self) -> StepTimes:
        return StepTimes(work=dict(self._work), copy_wait_s=self._copy_wait,
                         flush_s=self._flush, queue_s=self._queue,
                         gemms_warmed=self._gemms_warmed,
                         alloc_retries=alloc_retries(self.device) - self._retries)

    def add_work(self, phase: str, seconds: float) -> None:
        self._work[phase] = self._work.get(phase, 0.0) + seconds

    def flush(self) -> None:
        """aggressive_empty_cache() in the switch, outside compute: its seconds (a device sync
        and the allocator's frees: host work the ledger does not price) are `flush_s`."""
        t0 = time.perf_counter()
        aggressive_empty_cache()
        self._flush += time.perf_counter() - t0

    def timed(self, fn: Callable[[], T]) -> tuple[T, float]:
        """(fn's result, its wall seconds from an idle compute stream to the end of its work
        on it): a ledger action's clock (copies on other streams run on)."""
        wait_for_compute(self.device)
        t0 = time.perf_counter()
        result = fn()
        wait_for_compute(self.device)
        return result, time.perf_counter() - t0

    def compute(self, phase: str, fn: Callable[[], T]) -> T:
        """Run trainer compute `fn`; its wall time, less its waits for copies and the
        compute's idle time while the host queued copies back in it (`queueing`), is
        `phase`'s work."""
        wait_for_compute(self.device)
        waited, queued = self._copy_waits(), self._queue
        t0 = time.perf_counter()
        result = fn()
        wait_for_compute(self.device)
        for gap, gap_waited in self._queue_gaps:   # a wait is the compute's copy wait already
            self._queue += max(gap.seconds() - gap_waited, 0.0)
        self._queue_gaps = []
        waited = self._copy_waits() - waited
        self._copy_wait += waited
        self.add_work(phase, time.perf_counter() - t0 - waited - (self._queue - queued))
        return result

    def warm_up(self, fn: Callable[[], int]) -> None:
        """Launch GEMM shapes before copies are queued beside them (`fn` returns how many):
        its host time is queueing, not the pass's work."""
        t0 = time.perf_counter()
        self._gemms_warmed += fn()
        self._queue += time.perf_counter() - t0

    def queueing(self, fn: Callable[[], None]) -> None:
        """Host work inside compute that leaves the compute stream idle (queueing copies):
        the idle time, read once the stream drains, less the copy waits inside it."""
        gap, waited = ComputeGap(self.device), self._copy_waits()
        fn()
        gap.close()
        self._queue_gaps.append((gap, self._copy_waits() - waited))
