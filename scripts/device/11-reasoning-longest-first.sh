#!/usr/bin/env bash
# Device (one `run` call, ~4 min): the reasoning workload's generation against its HBM floor
# with decode attention in row order (HANDOFF_LONGEST_FIRST=0) and longest first (the
# default), same card: `handoff train examples/h200-reasoning.yaml run.steps=2
# rollout.kv_pool=elastic` each, then scripts/device/reasoning_floor.py on each run.
# Logs in $OUT/reasoning.tgz.
#   bash scripts/device/11-reasoning-longest-first.sh     (repo root, on the GPU machine)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/reasoning"; L=$OUT/reasoning
source scripts/device-env.sh > /dev/null || exit 1
timeout 60 python3 -m handoff init-model --preset qwen3-1.7b --out /tmp/qwen3-1.7b --device cuda \
    > "$L/init.log" 2>&1 || { echo "init-model failed"; tail -5 "$L/init.log"; exit 1; }
for lf in 0 1; do
    HANDOFF_LONGEST_FIRST=$lf timeout 150 python3 -m handoff train examples/h200-reasoning.yaml \
        run.steps=2 rollout.kv_pool=elastic run.checkpoint=false hardware.name=$HW \
        run.out_dir=/tmp/reasoning-lf$lf > "$L/train-lf$lf.log" 2>&1
    echo "longest first=$lf: train rc=$?"
    python3 scripts/device/reasoning_floor.py /tmp/reasoning-lf$lf > "$L/floor-lf$lf.log" 2>&1
    tail -4 "$L/floor-lf$lf.log"
    cp /tmp/reasoning-lf$lf/metrics.jsonl "$L/metrics-lf$lf.jsonl" 2>/dev/null
done
tar czf "$OUT/reasoning.tgz" -C "$OUT" reasoning && rm -rf "$L"
