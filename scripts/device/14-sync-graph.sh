#!/usr/bin/env bash
# Device (one `run` call, ~5 min): the LoRA sync's CUDA graph (HANDOFF_SYNC_GRAPH) checked and
# measured against launching each copy: the engine's LoRA CUDA tests, then the same Qwen3-1.7B
# LoRA run (STEPS, 4 unless set) with the graph on and off under host_probe.py, which prints each
# adapter load as launched, captured or replayed and the ledger's sync rows (issue 31).
#   bash scripts/device/14-sync-graph.sh           (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
timeout 200 python3 -m pytest -q -m cuda -x tests/rollout/test_engine_lora_cuda.py \
    > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: rc=$?"; tail -3 "$OUT/cuda-tests.log"
dir=/tmp/qwen3-1.7b
[ -f $dir/config.json ] || timeout 100 python3 -m handoff init-model \
    --preset qwen3-1.7b --out $dir --device cuda > "$OUT/init.log" 2>&1
for g in 1 0; do
    name=graph$g
    HANDOFF_SYNC_GRAPH=$g timeout 150 python3 scripts/device/host_probe.py \
        --json "$OUT/$name.json" -- examples/h200-4b.yaml model.path=$dir \
        actor.lora.rank=16 run.steps=${STEPS:-4} run.checkpoint=false rollout.kv_pool=elastic \
        actor.compile=false hardware.name=$HW run.out_dir="/tmp/$name" > "$OUT/$name.log" 2>&1
    echo "== HANDOFF_SYNC_GRAPH=$g: rc=$?"
    cp "/tmp/$name/summary.md" "$OUT/$name-summary.md" 2>/dev/null
    grep -E "^\| *(action|.*sync|switch)" "/tmp/$name/summary.md" 2>/dev/null
    grep -E "^(engine_weights_sync|adapter|launched|captured|replayed)" "$OUT/$name.log"
done
