#!/usr/bin/env bash
# Device (one `run` call, ~8 min): what the 2026-12-07 session built and no card has run yet.
# 1. longest-first decode attention: the public workload off and on, its CUDA tests
#    (10-longest-first.sh); 2. cuBLAS's split-K reduce at decode sizes (gemm_reduction_probe.py);
# 3. the largest LoRA run against its ledger with the adapter sync priced beside the Adam
#    state's D2H and the KV map priced on rested pages (3-largest-lora.sh, 2 steps; PRESET
#    picks the shape). Logs in $OUT (logs.tgz, gemm.log, the run's archive).
#   bash scripts/device/11-open-checks.sh         (repo root, on the GPU machine)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/device/10-longest-first.sh
source scripts/device-env.sh > /dev/null || exit 1
timeout 45 python3 scripts/device/gemm_reduction_probe.py > "$OUT/gemm.log" 2>&1
echo "gemm probe: rc=$?"; tail -16 "$OUT/gemm.log"
STEPS=2 RUN_TIMEOUT=${RUN_TIMEOUT:-240} bash scripts/device/3-largest-lora.sh 2>&1 | tail -30
