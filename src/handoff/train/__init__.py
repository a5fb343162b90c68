"""The training side of the colocated step: FSDP2 actor + reference, GRPO, offload, checkpoints.

    from handoff.train import RolloutBatch, build_actor, build_reference, save_checkpoint
"""

from handoff.train.actor import Actor, build_actor, build_reference
from handoff.train.batch import RolloutBatch
from handoff.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from handoff.train.model import Move, ShardedModel

__all__ = ["Actor", "ShardedModel", "Move", "RolloutBatch", "build_actor", "build_reference",
           "save_checkpoint", "load_checkpoint", "latest_checkpoint"]
