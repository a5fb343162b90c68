"""One rank of the two-process tensor-parallel LoRA job behind test_engine_lora.py.

    torchrun --nproc-per-node 2 tests/rollout/tp_lora_job.py CKPT ADAPTER OUT

Builds a float32 TP = 2 engine on CPU (gloo), loads the PEFT adapter file ADAPTER (rank 4,
alpha 8: each rank keeps its rows of the column-parallel B and its columns of the row-parallel
A), and writes the greedy tokens with the adapter and after clear_adapter to OUT/rank<r>.json.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from handoff.config import RolloutConfig
from handoff.dist import end_distributed_run, init_process_group, resolve_device
from handoff.rollout.engine import Engine
from handoff.rollout.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 9, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CFG = dict(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8)


def tokens(engine: Engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


def main(ckpt: str, adapter: str, out: Path) -> None:
    dev = resolve_device("cpu")
    init_process_group(dev)
    engine = Engine(ckpt, RolloutConfig(**CFG), device=dev, dtype=torch.float32, tp=2,
                    lora_max_rank=4)
    engine.load_adapter(load_file(adapter), alpha=8, rank=4)
    result = {"adapter": tokens(engine),
              "joined": sorted(name.rsplit(".", 1)[1] for name, linear in
                               engine.lora.linears.items() if linear.lora.joined is not None)}
    engine.clear_adapter()
    result["cleared"] = tokens(engine)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    end_distributed_run()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
