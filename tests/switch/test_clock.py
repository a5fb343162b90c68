"""StepClock: what a step's seconds are counted as (counts and sums; no time is asserted)."""

import torch

from handoff.switch import clock as clock_module
from handoff.switch.clock import StepClock


def test_queueing_and_copy_waits_are_counted_apart_from_work(fixed_compute_gap):
    waits = {"s": 0.0}
    clock = StepClock(torch.device("cpu"), lambda: waits["s"])

    def compute():
        waits["s"] += 0.1        # the model waited 0.1 s for a copy
        clock.warm_up(lambda: 3)
        clock.queueing(lambda: None)
        return "out"

    assert clock.compute("ref_forward", compute) == "out"
    times = clock.times()
    assert times.copy_wait_s == 0.1 and times.gemms_warmed == 3
    assert times.queue_s >= 0.25            # the gap, and the warm-up's host time
    assert set(times.work) == {"ref_forward"}
    clock.begin()                           # a new step starts from zero
    assert clock.times().work == {} and clock.times().queue_s == 0.0


def test_a_copy_wait_inside_a_queueing_gap_is_not_counted_twice(fixed_compute_gap):
    waits = {"s": 0.0}
    clock = StepClock(torch.device("cpu"), lambda: waits["s"])

    def queue_with_a_wait():
        waits["s"] += 0.2    # waited inside the gap: the compute's copy wait already

    clock.compute("update", lambda: clock.queueing(queue_with_a_wait))
    times = clock.times()
    assert times.copy_wait_s == 0.2 and abs(times.queue_s - 0.05) < 1e-12


def test_flushes_are_counted(monkeypatch):
    calls = []
    monkeypatch.setattr(clock_module, "aggressive_empty_cache", lambda: calls.append(1))
    clock = StepClock(torch.device("cpu"), lambda: 0.0)
    clock.flush()
    clock.flush()
    assert len(calls) == 2 and clock.times().flush_s >= 0.0
