"""The switch wing: the phases of a step in order (worker.py), the copies in flight
(copies.py), the step's clock (clock.py), and what they did (record.py). Where each ledger
action runs is `handoff.plan.order`."""

from handoff.switch.clock import StepTimes
from handoff.switch.record import Action, Generation, SwitchRecord
from handoff.switch.worker import HybridWorker

__all__ = ["Action", "Generation", "HybridWorker", "StepTimes", "SwitchRecord"]
