#!/usr/bin/env bash
# Device round 4 (one `run` call, < 10 min): the 4B colocated step (elastic pool, streamed
# switch) eager, then compiled twice with one compile cache (issue 32): the first compiled
# run pays the cold compile, the second starts from the cache. Each run's step 1 less its
# step 2 is its compile; the eager run's steps are the "before".
#   bash scripts/device/4-compile-second-start.sh  (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
export HANDOFF_CACHE="$OUT/cache"
handoff init-model --preset qwen3-4b --out /tmp/qwen3-4b --device cuda > "$OUT/init.log" 2>&1
for run in eager:false cold:true warm:true; do
    name=${run%%:*}; compile=${run##*:}
    timeout 170 handoff train examples/h200-4b.yaml run.steps=3 run.checkpoint=false \
        rollout.kv_pool=elastic actor.compile=$compile run.out_dir="$OUT/4b-$name" \
        > "$OUT/4b-$name.log" 2>&1
    echo "4B $name: rc=$?"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| run | step 1 s | step 2 s | step 3 s | train s (2, 3) | compiles |")
print("|---|---|---|---|---|---|")
for name in ("eager", "cold", "warm"):
    path = Path(sys.argv[1]) / f"4b-{name}" / "metrics.jsonl"
    if not path.exists():
        print(f"| {name} | - | - | - | - | - |")
        continue
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = " | ".join(f"{r['timing_s/step']:.2f}" for r in rows[:3])
    train = ", ".join(f"{r['timing_s/train']:.2f}" for r in rows[1:3])
    print(f"| {name} | {steps} | {train} | {[r.get('actor/compiles') for r in rows]} |")
PY
