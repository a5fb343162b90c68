#!/usr/bin/env bash
# Device round 4 (one `run` call, < 10 min): the 4B colocated step (elastic pool, streamed
# switch) eager, then compiled twice with one compile cache (issue 32): the first compiled
# run pays the cold compile, the second starts from the cache. Each run's step 1 less its
# step 2 is its compile; the eager run's steps are the "before". Then the reasoning
# workload's generation against the planner's and the HBM floor (issue 32: within 1.15x).
#   bash scripts/device/4-compile-second-start.sh  (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
export HANDOFF_CACHE="$OUT/cache"
handoff init-model --preset qwen3-4b --out /tmp/qwen3-4b --device cuda > "$OUT/init.log" 2>&1
for run in eager:false cold:true warm:true; do
    name=${run%%:*}; compile=${run##*:}
    timeout 140 python3 -m handoff train examples/h200-4b.yaml run.steps=2 run.checkpoint=false \
        rollout.kv_pool=elastic hardware.name=$HW actor.compile=$compile run.out_dir="$OUT/4b-$name" \
        > "$OUT/4b-$name.log" 2>&1
    echo "4B $name: rc=$?"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| run | step 1 s | step 2 s | train s (1, 2) | compiles |")
print("|---|---|---|---|---|")
for name in ("eager", "cold", "warm"):
    path = Path(sys.argv[1]) / f"4b-{name}" / "metrics.jsonl"
    if not path.exists():
        print(f"| {name} | - | - | - | - |")
        continue
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = " | ".join(f"{r['timing_s/step']:.2f}" for r in rows[:2])
    train = ", ".join(f"{r['timing_s/train']:.2f}" for r in rows[:2])
    print(f"| {name} | {steps} | {train} | {[r.get('actor/compiles') for r in rows]} |")
PY
timeout 40 python3 -m handoff init-model --preset qwen3-1.7b --out /tmp/qwen3-1.7b --device cuda \
    > "$OUT/init-1.7b.log" 2>&1
timeout 130 python3 -m handoff train examples/h200-reasoning.yaml run.steps=2 rollout.kv_pool=elastic \
    hardware.name=$HW run.out_dir="$OUT/reasoning" > "$OUT/reasoning.log" 2>&1
echo "reasoning workload: rc=$?"
python3 scripts/device/reasoning_floor.py "$OUT/reasoning"
