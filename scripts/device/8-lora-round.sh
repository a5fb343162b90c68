#!/usr/bin/env bash
# Device (one `run` call, < 10 min): the LoRA CUDA tests, the 1.7B's decode with and without
# a rank-16 adapter at batch 1 / 32 / 128 (issue 31: within 10%), then the largest shape's
# LoRA run against its ledger (3-largest-lora.sh).
#   bash scripts/device/8-lora-round.sh            (repo root, on the GPU machine; logs in $OUT)
#   LARGEST=0 bash scripts/device/8-lora-round.sh  (without the largest shape's run)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh > /dev/null || exit 1
echo "card: $HW"
timeout 150 python3 -m pytest -q -m cuda tests/rollout/test_kernels_fused.py \
    tests/rollout/test_engine_lora_cuda.py tests/test_loop_lora_cuda.py > "$OUT/tests.log" 2>&1
echo "LoRA and fused-kernel cuda tests: rc=$?"; tail -1 "$OUT/tests.log"
timeout 100 python3 -m handoff bench engine --skip-hf --no-public --models qwen3-1.7b \
    --batches 1,32,128 --lora-rank 16 --out "$OUT/engine.json" > "$OUT/bench.log" 2>&1
echo "bench engine: rc=$?"
python3 - "$OUT/engine.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["models"]["qwen3-1.7b"]["rows"]
print("| batch | base ms | LoRA r16 ms | LoRA x base | base x floor |\n|---|---|---|---|---|")
for r in rows:
    print(f"| {r['batch']} | {r['ms_per_step']:.3f} | {r['lora_ms_per_step']:.3f} | "
          f"{r['lora_over_base']:.3f} | {r['over_floor']:.2f} |")
PY
[ "${LARGEST:-1}" = 1 ] && STEPS=2 RUN_TIMEOUT=${RUN_TIMEOUT:-260} bash scripts/device/3-largest-lora.sh
