"""One rank of the two-process gloo job behind test_lora_multirank.py (or the whole job in one
process, WORLD_SIZE unset: the reference).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python lora_replica_job.py CKPT OUT SHARE

A LoRA actor (SHARE=1: its base a view of this rank's engine, replicas of the adapters;
SHARE=0: its own FSDP-sharded base) takes two updates on this rank's rows of fixed global
batches, each followed by the adapters' sync into the engine; OUT/<world>_rank<r>.pt holds
the adapters, the engine's weights' checksum before and after, and its adapter buffers.
"""

import os
import sys

import torch

from handoff.config import ActorConfig, LoraConfig, RolloutConfig
from handoff.dist import end_distributed_run, init_process_group, world_rank_size
from handoff.rollout.engine import Engine
from handoff.switch.lora import sync_lora
from handoff.trainer.actor import Actor
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.grpo import group_advantages
from test_actor import make_batch

RANK = 4
ROWS = {0: (0, 4), 1: (4, 8)}   # two groups of two per rank


def global_batch(seed: int) -> RolloutBatch:
    """test_actor's random batch in four groups of two, with rewards that differ in each."""
    batch = make_batch(seed, groups=4, n=2)
    batch.rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0, 1.0, 0.2])
    batch.advantages = group_advantages(batch.rewards, batch.group_size)
    return batch


def checksum(engine: Engine) -> float:
    return float(sum(p.double().abs().sum() for p in engine.model.parameters()))


def main(ckpt: str, out: str, share: bool) -> None:
    init_process_group(torch.device("cpu"))
    rank, world = world_rank_size()
    engine = Engine(ckpt, RolloutConfig(num_blocks=32, block_size=8, max_model_len=64,
                                        cuda_graphs=False),
                    device="cpu", dtype="float32", lora_max_rank=RANK)
    before = checksum(engine)
    torch.manual_seed(0)
    actor = Actor(ckpt, actor=ActorConfig(lr=1e-2, micro_batch_size=2,
                                          lora=LoraConfig(rank=RANK, alpha=8, share_base=share)),
                  dtype="float32", engine_base=engine.export_weight if share else None)
    actor.optimizer.eps = 1e-3   # Adam linear in the grads: reduction-order noise stays small
    grad_norms = []
    for seed in (1, 2):
        batch = global_batch(seed)
        grad_norms.append(actor.update(batch.rows(*ROWS[rank]) if world > 1 else batch)[
            "grad_norm"])
        if not share:   # its own base: the engine's backed up to the host and restored
            engine.sleep(1)
            engine.wake_up(["weights"])
        sync_lora(actor, engine)
    slot = engine.lora.linears["model.layers.0.mlp.gate_up_proj"].lora
    torch.save({"adapters": {n: t.clone() for n, t in actor.adapter_tensors()},
                "grad_norms": grad_norms, "before": before, "after": checksum(engine),
                "engine_B": slot.B.clone(), "parts": actor.memory_parts()},
               os.path.join(out, f"{world}_rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
    end_distributed_run()   # gloo's threads vs finalization: dist.end_distributed_run
