"""Saves checkpoints of a tiny actor, then stalls inside the third save so the test can kill -9.

    python ckpt_kill_job.py MODE CKPT ROOT     # MODE: mid_write | before_latest

Every tensor of checkpoint k (params and optimizer state) is filled with the value k, so
whatever the test loads afterwards shows which save it came from.
"""

import os
import sys
import time

from handoff.config import ActorConfig
from handoff.trainer.actor import Actor
from handoff.trainer.checkpoint import save_checkpoint
from handoff.trainer import checkpoint as ckpt_module


def stall(*_args, **_kwargs):
    print("STALL", flush=True)
    time.sleep(600)


def main(mode: str, ckpt: str, root: str) -> None:
    actor = Actor(ckpt, actor=ActorConfig(), dtype="float32")
    tensors = actor.part_tensors("params") + actor.part_tensors("optimizer")
    for step in (1, 2, 3):
        for t in tensors:
            t.fill_(float(step))
        if step == 3 and mode == "mid_write":
            os.fsync = stall            # DCP fsyncs each shard file as it finishes writing it
        if step == 3 and mode == "before_latest":
            ckpt_module.os.replace = stall
        save_checkpoint(root, actor, step=step, extra={"data_pos": 10 * step})
        print("SAVED", step, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
