"""The switch order, as data: which of the ledger's actions a step runs, where each starts,
and whether the step waits for it or it runs behind work. Written once, here:

    order = switch_order(cfg.memory, ref=True, elastic_pool=True, updates_per_step=1)
    [(m.action, m.phase, m.how) for m in order.moves]

`handoff.switch.worker` follows it, `plan.ledger` prices it (a move `behind` work is exposed
only by what it outlasts that work), the tests check the worker's moves against it.

Phases, in the step's order: `to_train` (after generation), `first_pass` (queued beside the
first trainer pass with room for it: the old policy's or the ref's forward, else the
update), `ref_forward`, `update`, `to_rollout`, `generation` (started under the next
generation, between its engine steps).

How a move runs:
* `wait`: started and waited for where it starts: the step waits for all of it;
* `start`: started, waited for by the compute that needs it (the ref's forward waits for
  its own copy back, the actor's for its params, the sequential optimizer copy to the host
  is waited for after the sync);
* `behind`: queued behind the phase's work, exposed only by what it outlasts it; moves
  behind the same work run in turn, in list order;
* `drop`: moves no bytes (the ref's device copy is dropped: its host copy is unchanged).

LoRA (`lora=True`, mode "lora"): the base is the engine's weights and the trainer's frozen
base at once, so nothing of it moves and the reference (the base with the adapters off) has no
copy: the sleep discards the KV only, the sync copies the adapters, the wake maps the KV; the
adapters' optimizer state, when offloaded, goes and comes as the streamed or sequential
optimizer move does (plan/lora.py prices it).

Why this order (the measurements behind each choice are in docs/PERF.md and docs/log/):
the sequential order is the source's; streamed, the params' and the optimizer's copies back
ride behind the forwards before the update (not the update: its backward's device copies
would wait behind them), and with an elastic KV pool the copies to the host start under
generation, which maps what is free beside them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from handoff.config import MemoryConfig

PHASES = ("to_train", "first_pass", "ref_forward", "update", "to_rollout", "generation")
HOWS = ("wait", "start", "behind", "drop")


@dataclass(frozen=True)
class Move:
    """One ledger action of the switch: where it starts and how the step meets it."""

    action: str             # a plan.ledger.SWITCH_ACTIONS name
    phase: str              # one of PHASES
    how: str                # one of HOWS
    by_kernel: bool = False  # an H2D copy done by a kernel, off the copy engines

    @property
    def part(self) -> str:
        """The owner it moves: "params", "optimizer", "ref", "engine", "kv_cache"."""
        return self.action.rsplit("_", 1)[0] if self.action.endswith(("_h2d", "_d2h")) \
            else self.action


@dataclass(frozen=True)
class SwitchOrder:
    """A step's moves in the order they start."""

    mode: str                # "sequential" | "streamed" | "lora"
    moves: tuple[Move, ...]

    def at(self, phase: str) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.phase == phase)

    def get(self, action: str) -> Move | None:
        return next((m for m in self.moves if m.action == action), None)

    def behind(self, phase: str) -> tuple[Move, ...]:
        """The moves that run behind `phase`'s work, in turn."""
        return tuple(m for m in self.at(phase) if m.how == "behind")


def switch_order(memory: MemoryConfig, *, ref: bool, elastic_pool: bool,
                 updates_per_step: int = 1, lora: bool = False) -> SwitchOrder:
    """The order a step runs its switch in (module docstring). An offload the config turns
    off has no move (the ledger prices it at 0 bytes)."""
    if lora:
        return _lora_order(memory, elastic_pool=elastic_pool)
    params, optimizer = memory.param_offload, memory.optimizer_offload
    ref_moves = ref and memory.ref_offload
    moves: list[Move] = [Move("engine_sleep", "to_train", "wait")]
    if not memory.overlap:
        # The source's order: every copy waited for where it starts. Right after a large
        # sleep the copy engines run at half rate while kernels do not: params and ref come
        # back by kernel.
        if params:
            moves.append(Move("params_h2d", "to_train", "wait", by_kernel=True))
        if ref_moves:
            moves += [Move("ref_h2d", "ref_forward", "wait", by_kernel=True),
                      Move("ref_d2h", "ref_forward", "wait")]
        if optimizer:
            moves.append(Move("optimizer_h2d", "update", "wait"))
        return SwitchOrder("sequential", tuple(moves + _to_rollout(memory, streamed=False)))
    actor_first = not ref or updates_per_step > 1
    if ref_moves:
        moves.append(Move("ref_h2d", "to_train", "start", by_kernel=True))
    if params:
        moves.append(Move("params_h2d", "to_train", "start", by_kernel=True) if actor_first
                      else Move("params_h2d", "first_pass", "behind"))
    if optimizer:
        moves.append(Move("optimizer_h2d", "first_pass", "behind"))
    if ref_moves:
        moves.append(Move("ref_d2h", "ref_forward", "drop"))
    return SwitchOrder("streamed", tuple(moves + _to_rollout(memory, streamed=elastic_pool)))


def _lora_order(memory: MemoryConfig, *, elastic_pool: bool) -> SwitchOrder:
    """LoRA's moves: the KV's sleep and wake, the adapters' sync, and the adapters' optimizer
    state where it is offloaded, placed as the full-parameter orders place the optimizer's."""
    moves = [Move("engine_sleep", "to_train", "wait")]
    if memory.optimizer_offload:
        moves.append(Move("optimizer_h2d", "first_pass", "behind") if memory.overlap
                     else Move("optimizer_h2d", "update", "wait"))
    no_params = dataclasses.replace(memory, param_offload=False)
    back = _to_rollout(no_params, streamed=memory.overlap and elastic_pool)
    return SwitchOrder("lora", tuple(moves + back))


def _to_rollout(memory: MemoryConfig, *, streamed: bool) -> list[Move]:
    """The switch back. In turn (and streamed with a fixed pool, which must be mapped whole
    at its wake): the optimizer's copy starts before the sync and is waited for after it,
    then the params' copy, then the KV wake. Streamed with an elastic pool: the KV wake
    right after the sync, both copies under the next generation, the optimizer's first."""
    sync, wake = (Move("engine_weights_sync", "to_rollout", "wait"),
                  Move("kv_cache_wake", "to_rollout", "wait"))
    if streamed:
        return [sync, wake] + [Move(f"{part}_d2h", "generation", "behind")
                               for part, on in (("optimizer", memory.optimizer_offload),
                                                ("params", memory.param_offload)) if on]
    return ([Move("optimizer_d2h", "to_rollout", "start")] if memory.optimizer_offload else []
            ) + [sync] + ([Move("params_d2h", "to_rollout", "wait")]
                          if memory.param_offload else []) + [wake]
