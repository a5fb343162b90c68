"""Host cost of one decode step: scheduler + input building + sampling inputs + postprocess.

    python -m handoff.bench.host_step --num-seqs 256 --steps 200

Everything an engine step does on the CPU except the model and the sampler kernels: it bounds
how fast a GPU decode step can be issued (a CUDA-graph replay takes ~10-50 us, so a host side
of a few ms would dominate a 5-20 ms step). Tokens are random, sequences never stop, and the
pool is large enough that nothing is preempted, so every step carries all `num_seqs`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from handoff.rollout.blocks import BlockManager
from handoff.rollout.graphs import DecodeInputs
from handoff.rollout.runner import ModelRunner, decode_rows
from handoff.rollout.sampling import SamplingParams, sample_key
from handoff.rollout.scheduler import Scheduler
from handoff.rollout.sequence import Sequence


def host_step_cost(num_seqs: int = 256, *, prompt_len: int = 256, block_size: int = 16,
                   steps: int = 200, warmup: int = 20, vocab: int = 151936,
                   seed: int = 0) -> dict:
    """Milliseconds per decode step on the host (median, mean, p90) and per phase (median).

    Every `block_size` steps all sequences fill a block at once and hash it: those steps are
    the slow tail (the p90 shows them when block_size <= 10).
    """
    rng = np.random.default_rng(seed)
    max_len = prompt_len + steps + warmup + 2
    per_seq = -(-max_len // block_size)
    blocks = BlockManager(num_seqs * per_seq + 1, block_size, max_num_seqs=num_seqs,
                          max_blocks_per_seq=per_seq)
    sched = Scheduler(blocks, max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * max_len,
                      max_model_len=max_len)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_len)
    for i in range(num_seqs):
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        sched.add(Sequence(i, prompt, params, request_index=i, sample_index=0,
                           key=sample_key(seed, i), stop_ids=frozenset({-1})))
    batch, is_prefill = sched.schedule()
    assert is_prefill and len(batch) == num_seqs
    sched.postprocess(batch, rng.integers(0, vocab, num_seqs).tolist(), [0.0] * num_seqs)
    inputs = DecodeInputs(num_seqs, per_seq, block_size, torch.device("cpu"))
    phases = {"schedule": [], "inputs": [], "sampling_inputs": [], "postprocess": []}
    totals = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        batch, _ = sched.schedule()
        t1 = time.perf_counter()
        # What the runner does before a decode forward (CPU: the staging buffer is the input).
        inputs.fill(*decode_rows(batch), blocks.tables, len(batch))
        t2 = time.perf_counter()
        inputs.fill_sampling(ModelRunner.sampling_batch(batch), len(batch))
        t3 = time.perf_counter()
        # The runner hands back Python lists (one .tolist() per step); so does this stand-in.
        tokens = rng.integers(0, vocab, len(batch)).tolist()
        sched.postprocess(batch, tokens, [0.0] * len(batch))
        t4 = time.perf_counter()
        assert len(batch) == num_seqs
        if step >= warmup:
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[name].append(dt * 1e3)
            totals.append((t4 - t0) * 1e3)
    return {"num_seqs": num_seqs, "block_size": block_size, "steps": steps,
            "ms_per_step_median": statistics.median(totals),
            "ms_per_step_mean": statistics.fmean(totals),
            "ms_per_step_p90": statistics.quantiles(totals, n=10)[-1],
            "us_per_seq_median": statistics.median(totals) * 1e3 / num_seqs,
            "phase_ms_median": {k: statistics.median(v) for k, v in phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    args = parser.parse_args()
    print(json.dumps(host_step_cost(args.num_seqs, steps=args.steps, block_size=args.block_size,
                                    prompt_len=args.prompt_len), indent=2))


if __name__ == "__main__":
    main()
