"""One rank of the two-process gloo job behind test_actor_distributed.py.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python dist_train_job.py CKPT OUT

Runs the FSDP2 actor on this rank's rows of a fixed global batch and writes what the test
compares against a single-process plain-torch GRPO to OUT/rank<r>.pt. The batch builders
live here so the test builds the very same global batches.
"""

import os
import sys

import torch

from handoff.config import ActorConfig
from handoff.dist import end_distributed_run
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.grpo import group_advantages

ACTOR = dict(lr=1e-2, micro_batch_size=2, kl_coef=0.05, entropy_coef=0.01, grad_clip=0.5,
             clip_low=0.2, clip_high=0.28)
# Adam's first step is lr * g / (|g| + eps): with the default eps a gradient of ~1e-8 turns
# fp32 reduction-order noise into a visible weight change; a large eps keeps it linear in g.
ADAM_EPS = 1e-3
GROUP = 2
ROWS = {0: (0, 4), 1: (4, 6)}   # rank 0: two groups, two micro-batches; rank 1: one of each


def global_batch(seed: int) -> RolloutBatch:
    """Six rows, three groups of two; ref log-probs and an old-policy offset fixed by seed."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(3):
        prompt = [256] + torch.randint(0, 256, (int(torch.randint(1, 4, (1,), generator=g)),),
                                       generator=g).tolist()
        for _ in range(GROUP):
            prompts.append(prompt)
            n = int(torch.randint(1, 6, (1,), generator=g))
            responses.append(torch.randint(0, 256, (n,), generator=g).tolist())
    rewards = [1.0, 0.0, 0.5, 0.5, 0.0, 2.0]
    batch = RolloutBatch.from_tokens(prompts, responses, rewards, group_size=GROUP, pad_id=259)
    shape = batch.input_ids.shape
    batch.ref_logprobs = -5.8 + 0.3 * torch.randn(shape, generator=g)
    batch.old_logprobs = 0.3 * torch.randn(shape, generator=g)   # an offset, added to logp later
    return batch


def local(batch: RolloutBatch, rank: int) -> RolloutBatch:
    return batch.rows(*ROWS[rank])


def main(ckpt: str, out: str) -> None:
    from handoff.trainer.actor import Actor
    from handoff.trainer.checkpoint import load_checkpoint, save_checkpoint

    rank = int(os.environ["RANK"])
    actor = Actor(ckpt, actor=ActorConfig(**ACTOR), dtype="float32")
    actor.optimizer.eps = ADAM_EPS
    res: dict = {"parts": actor.memory_parts(), "world": actor.world_size}
    res["full0"] = dict(actor.full_params())   # collective: every rank iterates

    # step 1, on-policy, through the two halves of update() so the grads can be read
    b1 = local(global_batch(1), rank)
    b1.old_logprobs = None
    b1.advantages = group_advantages(b1.rewards, b1.group_size)
    res["sums1"] = actor.accumulate(b1)
    res["grads1"] = {n: p.grad.full_tensor() for n, p in actor.module.named_parameters()}
    res["grad_norm1"] = actor.step()
    res["full1"] = dict(actor.full_params())

    # step 2, off-policy (old = current logp + offset), through update()
    b2 = local(global_batch(2), rank)
    res["logp2"], res["ent2"] = actor.log_probs(b2)
    b2.old_logprobs = res["logp2"] + b2.old_logprobs
    res["old2"] = b2.old_logprobs
    res["metrics2"] = actor.update(b2)
    res["full2"] = dict(actor.full_params())

    # offload / onload at world size 2
    keep = [t.clone() for t in actor.part_tensors("params") + actor.part_tensors("optimizer")]
    res["moved"] = actor.to("host", params=True, optimizer=True).wait()
    res["freed"] = sum(t.untyped_storage().nbytes() for t in
                       actor.part_tensors("params") + actor.part_tensors("optimizer"))
    res["back"] = actor.to("device", params=True, optimizer=True).wait()
    now = actor.part_tensors("params") + actor.part_tensors("optimizer")
    res["exact"] = all(torch.equal(a, b) for a, b in zip(keep, now))

    # checkpoint: the step after a resume equals the step after the save
    root = os.path.join(out, "ckpt")
    save_checkpoint(root, actor, step=2, extra={"data_pos": 12})
    b3 = local(global_batch(3), rank)
    res["metrics3"] = actor.update(b3)
    res["noise3"] = torch.rand(3)
    res["info"] = load_checkpoint(root, actor)
    res["metrics3_resumed"] = actor.update(local(global_batch(3), rank))
    res["noise3_resumed"] = torch.rand(3)

    # step 1 again under loss_agg=seq_mean: each sequence's token mean averaged over all six
    # sequences, though rank 0 holds four of them and rank 1 two
    seq_mean = Actor(ckpt, actor=ActorConfig(**ACTOR, loss_agg="seq_mean"), dtype="float32")
    b1 = local(global_batch(1), rank)
    b1.old_logprobs = None
    b1.advantages = group_advantages(b1.rewards, b1.group_size)
    seq_mean.accumulate(b1)
    res["grads1_seq_mean"] = {n: p.grad.full_tensor()
                              for n, p in seq_mean.module.named_parameters()}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_distributed_run()   # gloo's threads vs finalization: dist.end_distributed_run
