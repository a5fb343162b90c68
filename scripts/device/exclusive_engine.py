"""A colocated run's generation against the same engine alone on the card (issue 31: "no
slower than the exclusive-card engine with the same adapter").

    python3 scripts/device/exclusive_engine.py RUN_DIR [--steps 3]

Builds the run's engine by itself (its model, its rollout section, its LoRA rank: the
adapter's products run in every step whatever the adapter's values, so zero buffers cost
what a trained adapter costs), with the KV pool the run mapped at its largest wake
(`engine/kv_bytes`), and generates the run's own prompts of steps
1..N (the task's stream, the run's seeds and sampling). Prints each step's generation time
beside the run's `timing_s/gen`; step 1 builds kernels in both, so the comparison is steps 2+.
"""

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from handoff.config import load_config
from handoff.loop import step_prompts
from handoff.model_files import load_tokenizer
from handoff.plan.kvpool import kv_bytes_per_token_per_card
from handoff.plan.shapes import load_shape
from handoff.rollout.engine import Engine
from handoff.tasks import build_task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    cfg = load_config(args.run_dir / "config.json")
    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    kv_bytes = max(r.get("engine/kv_bytes", 0) for r in rows)
    if not kv_bytes:
        raise SystemExit(f"{args.run_dir}/metrics.jsonl has no engine/kv_bytes: pass a "
                         "finished handoff run's directory")
    # the run's pool: as many blocks as the colocated engine mapped at its largest wake
    shape = load_shape(cfg.model.path)
    element = 1 if cfg.rollout.kv_dtype == "fp8" else getattr(torch, cfg.model.dtype).itemsize
    per_block = kv_bytes_per_token_per_card(shape, 1, element) * cfg.rollout.block_size
    rollout = dataclasses.replace(cfg.rollout, kv_pool="fixed",
                                  num_blocks=int(kv_bytes // per_block))
    engine = Engine(cfg.model.path, rollout, device=args.device, dtype=cfg.model.dtype,
                    lora_max_rank=cfg.actor.lora.rank or None)
    tokenizer = load_tokenizer(cfg.model.path)
    task = build_task(cfg.data, seed=cfg.run.seed)
    print("| step | run's generation s | engine alone s | alone / run | KV GB alone |")
    print("|---|---|---|---|---|")
    ratios = []
    for step in range(min(args.steps, len(rows))):
        _, ids, _, params = step_prompts(cfg, task, tokenizer, step)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(ids, params)
        if args.device == "cuda":
            torch.cuda.synchronize()
        alone = time.perf_counter() - start
        engine.reset_prefix_cache()
        run_gen = rows[step]["timing_s/gen"]
        if step > 0:
            ratios.append(alone / run_gen)
        print(f"| {step + 1} | {run_gen:.2f} | {alone:.2f} | {alone / run_gen:.2f} | "
              f"{engine.runner.kv_cache_bytes / 1e9:.1f} |")
    if ratios:
        print(f"steps 2+: the engine alone takes {statistics.median(ratios):.2f}x the run's "
              f"generation (run's pool {kv_bytes / 1e9:.1f} GB)")


if __name__ == "__main__":
    main()
