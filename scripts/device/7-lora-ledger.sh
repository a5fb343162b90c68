#!/usr/bin/env bash
# Device (one `run` call, ~5 min on an H100): the Qwen3-8B shape with LoRA on the 4B example's
# workload, the base shared and held twice (both copies on the card), 3 steps each; prints
# each run's switch actions, planned (the ledger at the rates the run measured at its start)
# against measured (issue 31: every action within 25% of the ledger).
#   bash scripts/device/7-lora-ledger.sh           (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
STEPS=${STEPS:-3}; RUN_TIMEOUT=${RUN_TIMEOUT:-160}
[ -d /tmp/qwen3-8b ] || timeout 80 python3 -m handoff init-model --preset qwen3-8b \
    --out /tmp/qwen3-8b --device cuda > "$OUT/init-8b.log" 2>&1
for setting in ${SETTINGS:-true:true false:false}; do
    share=${setting%%:*}; offload=${setting##*:}
    timeout $RUN_TIMEOUT python3 -m handoff train examples/h200-4b.yaml model.path=/tmp/qwen3-8b \
        actor.lora.rank=16 actor.lora.share_base=$share memory.param_offload=$offload \
        run.steps=$STEPS run.checkpoint=false rollout.kv_pool=elastic hardware.name=$HW \
        run.out_dir="$OUT/ledger-share-$share" > "$OUT/ledger-share-$share.log" 2>&1
    echo "8B LoRA share_base=$share param_offload=$offload: rc=$?"
    grep -E "link rates|^\| *(action|optimizer|params|ref_|engine|kv_cache|switch)" \
        "$OUT/ledger-share-$share/summary.md" 2>/dev/null || tail -5 "$OUT/ledger-share-$share.log"
done
