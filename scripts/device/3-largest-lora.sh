#!/usr/bin/env bash
# Device round 3 (one `run` call, < 10 min): GRPO with LoRA on the largest Qwen3 shape the
# device can hold (issue 31): qwen3-32b (65.5 GB) on an H200 when /dev/shm has room for its
# checkpoint (the disk has 64 GiB), else qwen3-14b on the disk (an H100's 80 GB cannot hold
# the 32B base beside its adapters and activations: `handoff plan --model qwen3-32b
# --hardware h100-sxm --lora-rank 16` says so). Step parts, the KV pool, peak memory by
# owner and every switch action against the ledger are in the run's summary.md.
#   bash scripts/device/3-largest-lora.sh          (repo root, on the GPU machine; logs in $OUT)
#   STEPS=2 RUN_TIMEOUT=280 bash scripts/device/3-largest-lora.sh      (a shorter call)
#   PRESET=qwen3-14b bash scripts/device/3-largest-lora.sh             (the 14B on any card)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
shm_free=$(df --output=avail -B1 /dev/shm | tail -1)
if [ "${PRESET:-auto}" = auto ] && [ "$HW" = h200 ] && [ "$shm_free" -gt 72000000000 ]; then
    preset=qwen3-32b; dir=/dev/shm/qwen3-32b
else preset=qwen3-14b; dir=/tmp/qwen3-14b; fi
echo "largest shape: $preset in $dir (/dev/shm free: $shm_free B)"
STEPS=${STEPS:-3}; RUN_TIMEOUT=${RUN_TIMEOUT:-330}
timeout 200 python3 -m handoff init-model --preset $preset --out $dir --device cuda > "$OUT/init.log" 2>&1
echo "init-model: rc=$?"
timeout $RUN_TIMEOUT python3 -m handoff train examples/h200-4b.yaml model.path=$dir actor.lora.rank=16 run.steps=$STEPS \
    run.checkpoint=false rollout.kv_pool=elastic hardware.name=$HW run.out_dir="/tmp/lora-$preset" \
    > "$OUT/lora-$preset.log" 2>&1
echo "train: rc=$?"
# A call brings back at most 8 files: the run's summaries and metrics in one archive.
tar czf "$OUT/lora-$preset.tgz" -C /tmp "lora-$preset/summary.md" "lora-$preset/summary.json" \
    "lora-$preset/metrics.jsonl" 2>/dev/null
tail -40 "/tmp/lora-$preset/summary.md" 2>/dev/null || tail -20 "$OUT/lora-$preset.log"
