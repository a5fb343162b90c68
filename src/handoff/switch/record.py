"""What the switch did, as values: a ledger action's measured seconds and bytes, a move's
record of them, and what a step's generation did.

    record = SwitchRecord()
    record.add("params_h2d", seconds, nbytes)
    step = SwitchRecord.merged([to_train, ref_moves, optimizer_moves, to_rollout, landed])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from handoff.plan.ledger import SWITCH_ACTIONS
from handoff.sync.weights import SyncStats


@dataclass
class Action:
    """One ledger action as measured: seconds on its clock and bytes moved."""

    seconds: float = 0.0
    bytes: int = 0


@dataclass
class SwitchRecord:
    """What a move of the worker did: its ledger actions (in the order they started, by
    `moved`), and for the switch back to rollout the weight sync's stats and the time the
    weights' region took to map."""

    actions: dict[str, Action] = field(default_factory=dict)
    sync: SyncStats | None = None
    weights_wake_seconds: float = 0.0

    def add(self, action: str, seconds: float, nbytes: int) -> None:
        entry = self.actions.setdefault(action, Action())
        entry.seconds += seconds
        entry.bytes += int(nbytes)

    def add_moves(self, moved: dict[str, dict], direction: str) -> None:
        """A `ShardedModel.to(...).wait()` result, part by part, as `<part>_<direction>`."""
        for part, r in moved.items():
            self.add(f"{part}_{direction}", r["seconds"], r["bytes"])

    @classmethod
    def merged(cls, records: list["SwitchRecord"]) -> "SwitchRecord":
        """A step's records as one: every ledger action present (0 s / 0 B when it did not
        run, so a step's metrics keep one shape), the sync of the one that synced."""
        out = cls(actions={a: Action() for a in SWITCH_ACTIONS})
        for r in records:
            for name, a in r.actions.items():
                out.add(name, a.seconds, a.bytes)
            if r.sync is not None:
                out.sync, out.weights_wake_seconds = r.sync, r.weights_wake_seconds
        return out

    @property
    def raw_seconds(self) -> float:
        """The actions' own seconds, summed."""
        return sum(a.seconds for a in self.actions.values())


@dataclass(frozen=True)
class Generation:
    """A step's generation: the engine's outputs, its wall seconds, and the engine's stats
    after it with this step's share of its counters (preemptions, decode steps and seconds,
    prefill seconds)."""

    outputs: list
    seconds: float
    engine: dict
