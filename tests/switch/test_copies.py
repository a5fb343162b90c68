"""CopiesInFlight on its own: a fake actor whose copies are Transfers that report done only
when told, so the order of starts, landings and waits is checked without a Run."""

import torch

from handoff.config import MemoryConfig
from handoff.memory.staging import Transfer
from handoff.switch import copies as copies_module
from handoff.switch.clock import StepClock
from handoff.switch.copies import CopiesInFlight
from handoff.switch.record import SwitchRecord
from handoff.train.model import Move

PARTS = {"params": 100, "optimizer": 600}


class FakeCopy(Transfer):
    """A copy that is done once `finish()` is called (or waited for); logs its wait."""

    def __init__(self, name, nbytes, log):
        super().__init__(name, nbytes, seconds=0.5)
        self.finished, self.log = False, log

    def done(self):
        return self.finished

    def wait(self):
        if not self.finished:
            self.log.append(f"waited {self.name}")
        self.finished = True
        super().wait()


class FakeActor:
    def __init__(self):
        self.log: list[str] = []
        self.copies: list[FakeCopy] = []
        self.copy_wait_seconds = 0.0

    def memory_parts(self):
        return dict(PARTS)

    def to(self, where, *, by_kernel=False, programs=None, **parts):
        transfers = {}
        for part in parts:
            copy = FakeCopy(f"{part}->{where}", PARTS[part], self.log)
            self.log.append(f"start {copy.name}" + (" by kernel" if by_kernel else ""))
            self.copies.append(copy)
            transfers[part] = copy
        return Move(transfers)


def _copies(memory=MemoryConfig(), said=None):
    actor = FakeActor()
    clock = StepClock(torch.device("cpu"), lambda: actor.copy_wait_seconds)
    say = (lambda key, text: said.append(key)) if said is not None else (lambda *a: None)
    return actor, CopiesInFlight(actor, None, memory, clock=clock, say_once=say)


def test_copies_to_the_host_start_one_at_a_time_and_land_without_waiting():
    actor, copies = _copies()
    copies.queue_to_host(["optimizer", "params"])
    assert copies.pending and not copies.in_flight
    copies.start_queued_to_host()
    copies.start_queued_to_host()            # the optimizer's is in flight: no second start
    assert actor.log == ["start optimizer->host"]
    assert not copies.land_finished()        # not done: nothing lands, nothing waits
    actor.copies[0].finished = True
    assert copies.land_finished()
    copies.start_queued_to_host()
    assert actor.log == ["start optimizer->host", "start params->host"]
    copies.settle()                          # the params' copy is waited for
    assert actor.log[-1] == "waited params->host" and not copies.pending
    landed = copies.take_landed()
    assert {a: x.bytes for a, x in landed.actions.items()} == {"optimizer_d2h": 600,
                                                               "params_d2h": 100}
    assert copies.take_landed().actions == {}   # taken once


def test_settle_starts_and_lands_every_queued_copy_in_order():
    actor, copies = _copies()
    copies.queue_to_host(["optimizer", "params"])
    copies.settle()
    assert actor.log == ["start optimizer->host", "waited optimizer->host",
                         "start params->host", "waited params->host"]


def test_parts_due_back_are_queued_while_the_card_has_room(monkeypatch):
    actor, copies = _copies(MemoryConfig(wake_margin_mb=0))
    # 650 B free, less what the copies back already queued take.
    monkeypatch.setattr(copies_module, "device_free_bytes", lambda device: 650 - sum(
        c.bytes for c in actor.copies if c.name.endswith("device")))
    copies.due_back = ["params", "optimizer"]
    record = SwitchRecord()
    copies.stream_due_back(record)           # room for the params (100), not the optimizer
    assert actor.log == ["start params->device"] and copies.due_back == ["optimizer"]
    assert copies.coming_back("params") and not copies.coming_back("optimizer")
    copies.land_coming_back(record)
    assert record.actions["params_h2d"].bytes == 100


def test_without_room_the_last_pass_brings_a_part_back_now_and_says_so(monkeypatch):
    said = []
    actor, copies = _copies(MemoryConfig(wake_margin_mb=0), said)
    monkeypatch.setattr(copies_module, "device_free_bytes", lambda device: 10)
    copies.due_back = ["optimizer"]
    record = SwitchRecord()
    copies.stream_due_back(record)
    assert copies.due_back == ["optimizer"] and actor.log == [] and said == []
    copies.stream_due_back(record, last=True)   # the update: the sequential order
    assert copies.due_back == [] and said == ["optimizer back"]
    assert actor.log == ["start optimizer->device", "waited optimizer->device"]
    assert record.actions["optimizer_h2d"].bytes == 600
    assert actor.copy_wait_seconds > 0          # the compute's wait for a copy


def test_the_optimizer_comes_back_by_a_kernel_of_the_programs_asked_for(monkeypatch):
    actor, copies = _copies(MemoryConfig(optimizer_back_programs=8))
    monkeypatch.setattr(copies_module, "device_free_bytes", lambda device: None)
    assert copies.stream_back(SwitchRecord(), "optimizer", wait=False)
    assert actor.log == ["start optimizer->device by kernel"]
