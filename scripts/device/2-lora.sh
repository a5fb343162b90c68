#!/usr/bin/env bash
# Device round 2 (one `run` call, < 10 min): decode with a rank-16 adapter vs without on the
# 1.7B and 4B shapes (issue 31: within 10%; issue 32: the floors, prefill % of peak), then a
# Qwen3-8B shape with LoRA, the base shared vs held twice (4 steps each, elastic pool).
#   bash scripts/device/2-lora.sh                  (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
timeout 240 handoff bench engine --skip-hf --no-public --lora-rank 16 --out "$OUT/engine-lora.json" \
    > "$OUT/engine-lora.log" 2>&1
echo "bench engine --lora-rank 16: rc=$?"
python3 scripts/device/summary.py "$OUT/engine-lora.json"
handoff init-model --preset qwen3-8b --out /tmp/qwen3-8b --device cuda > "$OUT/init-8b.log" 2>&1
for share in true false; do
    timeout 150 handoff train examples/h200-4b.yaml model.path=/tmp/qwen3-8b actor.lora.rank=16 \
        actor.lora.share_base=$share run.steps=4 run.checkpoint=false rollout.kv_pool=elastic \
        run.out_dir="$OUT/lora-8b-share-$share" > "$OUT/lora-8b-share-$share.log" 2>&1
    echo "8B LoRA share_base=$share: rc=$? $(tail -2 "$OUT/lora-8b-share-$share.log" | head -1)"
done
