#!/usr/bin/env bash
# Device round 1 (one `run` call, < 10 min): every cuda test, the checkpoint written under the
# device's Python, then the whole decode bench: the 1.7B and 4B shapes at batch 1/32/128/256
# with and without a rank-16 adapter (issue 31: within 10%; issue 32: the floors, prefill %
# of peak, the GEMM library chosen per batch size) and the public 0.6B workload.
#   bash scripts/device/1-tests-and-decode.sh      (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: rc=$? $(tail -1 "$OUT/cuda-tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/cuda-tests.log" | cut -c1-220 | head -20
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_checkpoint_pythons.py \
    > "$OUT/pythons.log" 2>&1
echo "checkpoint under this Python: rc=$? $(tail -1 "$OUT/pythons.log")"
timeout 280 python3 -m handoff bench engine --skip-hf --lora-rank 16 --out "$OUT/engine.json" \
    > "$OUT/engine.log" 2>&1
echo "bench engine --lora-rank 16: rc=$?"; grep -E "measured|Error|error" "$OUT/engine.log" | tail -5
python3 scripts/device/summary.py "$OUT/engine.json"
