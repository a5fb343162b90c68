#!/usr/bin/env bash
# Device (one `run` call, ~6 min): the LoRA term left to its readers (HANDOFF_LORA_DEFER=1,
# o/gate-up/down only, B read in row tiles) against the expand GEMM on the 1.7B at batch 1 /
# 32 / 128, with its CUDA tests; then the KV wake's calibration probe (calib_probe.py).
# Logs in one archive, $OUT/logs.tgz (a call brings back at most 8 files).
#   bash scripts/device/9-defer-and-calib.sh        (repo root, on the GPU machine)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"; L=$OUT/logs
source scripts/device-env.sh > /dev/null || exit 1
echo "card: $HW"
HANDOFF_LORA_DEFER=1 timeout 150 python3 -m pytest -q -m cuda tests/rollout/test_kernels_fused.py \
    tests/rollout/test_engine_lora_cuda.py > "$L/tests.log" 2>&1
rc=$?; echo "fused + engine lora cuda tests (defer on): rc=$rc"; tail -1 "$L/tests.log"
for defer in 0 1; do
    [ $rc -ne 0 ] && [ $defer = 1 ] && continue
    HANDOFF_LORA_DEFER=$defer timeout 100 python3 -m handoff bench engine --skip-hf --no-public \
        --models qwen3-1.7b --batches 1,32,128 --lora-rank 16 --out "$L/engine-$defer.json" \
        > "$L/bench-$defer.log" 2>&1
    echo "bench engine, HANDOFF_LORA_DEFER=$defer: rc=$?"
done
timeout 150 python3 scripts/device/calib_probe.py --gib 36 --held-gib 29.5 --replay-gib 12,30 \
    --repeats 2 > "$L/calib.log" 2>&1
echo "calib probe: rc=$?"
timeout 120 python3 -m pytest -q -m cuda tests/test_loop_lora_cuda.py > "$L/loop-lora.log" 2>&1
echo "loop lora cuda test: rc=$?"; tail -1 "$L/loop-lora.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
for defer in 0 1; do
    tar xzf "$OUT/logs.tgz" -O "logs/engine-$defer.json" > /tmp/e.json 2>/dev/null || continue
    python3 - /tmp/e.json $defer <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["models"]["qwen3-1.7b"]["rows"]
print(f"defer={sys.argv[2]}\n| batch | base ms | LoRA r16 ms | LoRA x base | base x floor |\n|---|---|---|---|---|")
for r in rows:
    print(f"| {r['batch']} | {r['ms_per_step']:.3f} | {r['lora_ms_per_step']:.3f} | "
          f"{r['lora_over_base']:.3f} | {r['over_floor']:.2f} |")
PY
done
tar xzf "$OUT/logs.tgz" -O logs/calib.log | tail -16
