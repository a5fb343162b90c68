"""One rank of the two-process tensor-parallel engine job behind test_parallel_engine.py.

    torchrun --nproc-per-node 2 tests/rollout/tp_engine_job.py CKPT OUT [cpu|cuda]

Builds a float32 TP = 2 engine on CPU (gloo) or on one GPU per rank (NCCL), generates, sleeps, wakes and re-syncs every weight through
`sync_weights` with the checksum readback, and writes what each rank saw (tokens, region
states, KV shape, sync stats, the errors it raised) to OUT/rank<r>.json.
"""

import json
import sys
from pathlib import Path

import torch

from handoff.config import RolloutConfig
from handoff.errors import HandoffError
from handoff.rollout.engine import Engine
from handoff.rollout.models import iter_checkpoint
from handoff.dist import end_distributed_run
from handoff.rollout.sampling import SamplingParams
from handoff.sync.weights import sync_weights
from handoff.dist import init_process_group, resolve_device

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 9, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, n=2, max_tokens=8, seed=11, ignore_eos=True)
CFG = dict(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8)


def tokens(outputs) -> list[list[int]]:
    return [s.token_ids for o in outputs for s in o.outputs]


def regions(engine: Engine) -> dict:
    """Which regions are awake and what they hold now: storage bytes on CPU (a sleeping
    region's storages shrink to 0), the driver's free bytes on CUDA (pages are unmapped)."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
    return {"awake": {t: engine.pool.is_awake(t) for t in ("weights", "kv_cache")},
            "kv_bytes": engine.runner.kv_storage.untyped_storage().nbytes(),
            "weight_bytes": sum(p.untyped_storage().nbytes() for p in engine.model.parameters()),
            "device_free": torch.cuda.mem_get_info(engine.device)[0] if cuda else None,
            "region_bytes": {t: engine.pool.region_bytes(t) for t in ("weights", "kv_cache")}}


def error_of(fn) -> str | None:
    try:
        fn()
    except HandoffError as e:
        return str(e)
    return None


def main(ckpt: str, out: Path, device: str = "cpu") -> None:
    dev = resolve_device(device)
    init_process_group(dev)
    rank = torch.distributed.get_rank()
    engine = Engine(ckpt, RolloutConfig(**CFG), device=dev, dtype=torch.float32, tp=2)
    result = {"stats": engine.stats(), "kv_shape": list(engine.runner.kv_storage.shape),
              "greedy": tokens(engine.generate(PROMPTS, GREEDY)),
              "sampled": tokens(engine.generate(PROMPTS, SAMPLED)),
              "unseeded": tokens(engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=6)))}
    states = {"awake": regions(engine)}
    engine.sleep(2)
    states["asleep"] = regions(engine)
    result["asleep_error"] = error_of(lambda: engine.generate(PROMPTS, GREEDY))
    engine.wake_up(["weights"])
    states["weights_awake"] = regions(engine)
    # Checking the full tensors against what a rank holds must fail: it keeps a shard.
    result["unsliced_verify_error"] = error_of(lambda: sync_weights(
        iter_checkpoint(ckpt), engine.load_weights, bucket_bytes=1 << 16, device=dev,
        readback=engine.export_weight))
    stats = sync_weights(iter_checkpoint(ckpt), engine.load_weights, bucket_bytes=1 << 16,
                         device=dev, readback=engine.export_weight, select=engine.weight_shard)
    result["sync"] = {"buckets": stats.num_buckets, "verified": stats.verified_buckets,
                      "tensors": stats.num_tensors}
    engine.wake_up(["kv_cache"])
    states["awake_again"] = regions(engine)
    result["greedy_after_sync"] = tokens(engine.generate(PROMPTS, GREEDY))
    result["mismatch_error"] = error_of(lambda: engine.generate([[1, 2, 3 + rank]], GREEDY))
    result["states"] = states
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_distributed_run()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
