"""The training side of the colocated step: FSDP2 actor + reference, GRPO, offload, checkpoints.

    from handoff.trainer.actor import build_actor, build_reference
    from handoff.trainer.batch import RolloutBatch
    from handoff.trainer.checkpoint import save_checkpoint, load_checkpoint

Files: model.py (ShardedModel: FSDP2 wrap, log-probs, full params, offload of its parts),
actor.py (+ grads, optimizer, the GRPO update), optim.py, grpo.py, batch.py, checkpoint.py.
"""
