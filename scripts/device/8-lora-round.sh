#!/usr/bin/env bash
# Device (one `run` call, < 10 min): the LoRA CUDA tests, the 1.7B's decode with and without
# a rank-16 adapter at batch 1 / 32 / 128 (issue 31: within 10%), the adapter's expand as a
# GEMM (the default) and left to the fused kernels (HANDOFF_LORA_DEFER=1, skipped when a CUDA
# test failed), then the largest shape's LoRA run against its ledger (3-largest-lora.sh).
#   bash scripts/device/8-lora-round.sh            (repo root, on the GPU machine; logs in $OUT)
#   LARGEST=0 bash scripts/device/8-lora-round.sh  (without the largest shape's run)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh > /dev/null || exit 1
echo "card: $HW"
timeout 110 python3 -m pytest -q -m cuda tests/rollout/test_kernels_fused.py \
    tests/rollout/test_engine_lora_cuda.py tests/rollout/test_graphs_cuda.py > "$OUT/tests.log" 2>&1
rc=$?; echo "rollout cuda tests: rc=$rc"; tail -2 "$OUT/tests.log"
HANDOFF_LORA_DEFER=1 timeout 60 python3 -m pytest -q -m cuda tests/rollout/test_engine_lora_cuda.py \
    > "$OUT/tests-defer.log" 2>&1 || rc=1
echo "engine lora cuda test, HANDOFF_LORA_DEFER=1: rc=$rc"; tail -1 "$OUT/tests-defer.log"
timeout 60 python3 -m pytest -q -m cuda tests/test_loop_lora_cuda.py > "$OUT/tests2.log" 2>&1
echo "loop lora cuda test: rc=$?"; tail -1 "$OUT/tests2.log"
for defer in 0 1; do   # the LoRA term's expand as a GEMM, then left to the kernels that read it
    [ $rc -ne 0 ] && [ $defer = 1 ] && continue
    HANDOFF_LORA_DEFER=$defer timeout 100 python3 -m handoff bench engine --skip-hf --no-public \
        --models qwen3-1.7b --batches 1,32,128 --lora-rank 16 --out "$OUT/engine-$defer.json" \
        > "$OUT/bench-$defer.log" 2>&1
    echo "bench engine, HANDOFF_LORA_DEFER=$defer: rc=$?"
    python3 - "$OUT/engine-$defer.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["models"]["qwen3-1.7b"]["rows"]
print("| batch | base ms | LoRA r16 ms | LoRA x base | base x floor |\n|---|---|---|---|---|")
for r in rows:
    print(f"| {r['batch']} | {r['ms_per_step']:.3f} | {r['lora_ms_per_step']:.3f} | "
          f"{r['lora_over_base']:.3f} | {r['over_floor']:.2f} |")
PY
done
[ "${LARGEST:-1}" = 1 ] && STEPS=2 RUN_TIMEOUT=${RUN_TIMEOUT:-260} bash scripts/device/3-largest-lora.sh
