"""The copies of the trainer's state that outlive the move that starts them, in one place.

    copies = CopiesInFlight(actor, ref, memory_cfg, clock=clock, say_once=say)
    copies.queue_to_host(["optimizer", "params"])   # started under the next generation
    copies.land_finished()                          # between engine steps: never waits
    copies.due_back = ["params", "optimizer"]       # queued beside the first trainer pass
    copies.stream_due_back(record)                  # ... while the card has room for them
    copies.settle()                                 # everything to the host landed

To the host: one D2H stream, one copy at a time (a later one starts once the one in flight
has landed, so the cache emptied at a landing waits for no copy of ours); a copy is recorded
in the record of the move it lands in, or, landing outside one (generation, `settle`), in
`take_landed()`: either way in the step it lands in.

Back to the card: the ref's copy (by kernel; its forward waits for it), and the actor's
parts queued beside a pass once the card has room for them (the room check: the card holds
at most what it holds in the update, so only the part's bytes are checked); without room a
part waits for the next pass, and at the last one (the update's) comes back at once, the
sequential order, said once. The compute that needs a part waits for it.
"""

from __future__ import annotations

import time
from typing import Callable

from handoff.config import MemoryConfig
from handoff.memory.allocator import device_free_bytes
from handoff.memory.staging import Transfer
from handoff.switch.clock import StepClock
from handoff.switch.record import SwitchRecord
from handoff.train.actor import Actor
from handoff.train.model import Move, ShardedModel
from handoff.units import fmt_bytes


class CopiesInFlight:
    """The trainer state's copies in flight and queued, both directions."""

    def __init__(self, actor: Actor, ref: ShardedModel | None, memory: MemoryConfig, *,
                 clock: StepClock, say_once: Callable[[str, str], None]):
        self.actor, self.ref, self.memory = actor, ref, memory
        self.device = clock.device
        self._clock, self._say_once = clock, say_once
        self._to_host: list[tuple[str, Transfer]] = []   # (ledger action, copy), in stream order
        self._queued_to_host: list[str] = []   # parts whose D2H starts once the stream is free
        self.landed = SwitchRecord()           # copies that landed outside a move
        self.ref_back: Move | None = None      # the ref's copy back, started, not waited for
        self.due_back: list[str] = []          # actor parts to queue beside the next pass
        self._coming_back: dict[str, Move] = {}   # actor parts' copies back, not yet waited

    # ---------------------------------------------------------------- to the host

    @property
    def pending(self) -> bool:
        """A copy of the trainer's state to the host is in flight or queued."""
        return bool(self._to_host or self._queued_to_host)

    @property
    def in_flight(self) -> bool:
        """A copy to the host has started and not landed."""
        return bool(self._to_host)

    def start_to_host(self, part: str) -> None:
        """Start the copy of an actor part to the host (async on CUDA); `land` lands it."""
        transfer = self.actor.to("host", **{part: True}).transfers[part]
        if transfer is not None:
            self._to_host.append((f"{part}_d2h", transfer))

    def queue_to_host(self, parts: list[str]) -> None:
        """Parts whose copies start one after the other, by `start_queued_to_host`."""
        self._queued_to_host += parts

    def start_queued_to_host(self) -> None:
        """The next queued part's copy, once the one in flight has landed."""
        if self._queued_to_host and not self._to_host:
            self.start_to_host(self._queued_to_host.pop(0))

    def land(self, record: SwitchRecord, *, wait: bool) -> bool:
        """Land the copies to the host that have finished (wait: all in flight): their device
        memory is freed, their actions recorded. Returns whether any landed."""
        landed = False
        while self._to_host and (wait or self._to_host[0][1].done()):
            action, transfer = self._to_host.pop(0)
            transfer.wait()
            record.add(action, transfer.seconds, transfer.bytes)
            landed = True
        return landed

    def land_finished(self) -> bool:
        """Land what has finished, never waiting (between engine steps); whether any did."""
        return self.land(self.landed, wait=False)

    def settle(self) -> None:
        """Wait for every copy to the host still pending and land it: before anything that
        needs the trainer's state on the host or the card back (a checkpoint, a resume, the
        run's end). Their actions go to `take_landed()`."""
        while self.pending:
            self.land(self.landed, wait=True)
            self._clock.flush()
            self.start_queued_to_host()

    def take_landed(self) -> SwitchRecord:
        """The copies that landed outside a move since the last call (generation, `settle`)."""
        record, self.landed = self.landed, SwitchRecord()
        return record

    # ---------------------------------------------------------------- back to the card

    def start_ref_back(self) -> Move | None:
        if self.ref is None or not self.memory.ref_offload:
            return None
        return self.ref.to("device", params=True, by_kernel=True)

    def stream_due_back(self, record: SwitchRecord, *, last: bool = False) -> None:
        """Queue the parts due back, in order, while the card has room for them beside what
        runs now; what has none waits for the next pass, or at the `last` comes back now."""
        while self.due_back and self.stream_back(record, self.due_back[0], wait=last):
            self.due_back.pop(0)

    def stream_back(self, record: SwitchRecord, part: str, *, by_kernel: bool = False,
                    wait: bool = True) -> bool:
        """Queue the copy back of the actor's offloaded `part`, not waited for: the compute
        that needs it waits (the actor's forward for the params, the update for the
        optimizer). Returns False if it is left for later (`wait` False and no room).

        Without room it comes back now when `wait` (the sequential order, said once); called
        inside compute, that wait is the compute's wait for a copy."""
        free = device_free_bytes(self.device)
        need = self.actor.memory_parts()[part] + (self.memory.wake_margin_mb << 20)
        if free is None or free >= need:
            programs = None
            if part == "optimizer" and self.memory.optimizer_back_programs:
                by_kernel, programs = True, self.memory.optimizer_back_programs
            self._coming_back[part] = self.actor.to("device", by_kernel=by_kernel,
                                                    programs=programs, **{part: True})
            return True
        if not wait:
            return False
        self._say_once(f"{part} back", f"memory.overlap: the actor's {part} need "
                       f"{fmt_bytes(need)} beside what the card holds, {fmt_bytes(free)} is "
                       "free: they come back before the compute that needs them instead (the "
                       "sequential order); offload less or lower actor.micro_batch_tokens to "
                       "overlap it")
        t0 = time.perf_counter()
        moved = self.actor.to("device", by_kernel=part == "params", **{part: True}).wait()
        self.actor.copy_wait_seconds += time.perf_counter() - t0
        record.add_moves(moved, "h2d")
        return True

    def coming_back(self, part: str) -> bool:
        """`part`'s copy back is queued and not yet recorded."""
        return part in self._coming_back

    def land_coming_back(self, record: SwitchRecord) -> None:
        """Record the copies back (landed by now: the compute that needed them waited)."""
        for move in self._coming_back.values():
            record.add_moves(move.wait(), "h2d")
        self._coming_back.clear()
