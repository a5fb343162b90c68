#!/usr/bin/env bash
# Device round 5 (one `run` call, < 10 min): the Triton skinny product (kernels/skinny.py) against
# cuBLAS in the same call. Its tests first (the kernel at real shapes, the linears routed to it,
# captured; an engine decoding with it equals its eager self; LoRA graphs = eager with it),
# then `handoff bench engine` at batch 1 and 32 on the 1.7B and 4B shapes with a rank-16
# adapter, under cublas and under triton (issue 32: batch 1 <= 1.4x the floor; issue 31: the
# adapter within 10% of the base), then auto (each backend timed per ladder size) with the
# public workload and its prefill timed twice (the first of its shapes apart).
#   bash scripts/device/5-skinny-gemm.sh           (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/rollout/test_kernels_skinny.py \
    tests/rollout/test_graphs_cuda.py tests/rollout/test_engine_lora_cuda.py \
    > "$OUT/skinny-tests.log" 2>&1
echo "skinny tests: rc=$? $(tail -1 "$OUT/skinny-tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/skinny-tests.log" | cut -c1-220 | head -10
for gemm in cublas triton; do
    timeout 120 python3 -m handoff bench engine --skip-hf --no-public --batches 1,32 \
        --lora-rank 16 --decode-gemm $gemm --out "$OUT/engine-$gemm.json" \
        > "$OUT/engine-$gemm.log" 2>&1
    echo "bench engine --decode-gemm $gemm: rc=$?"; grep -E "Error|error" "$OUT/engine-$gemm.log" | tail -3
done
timeout 200 python3 -m handoff bench engine --skip-hf --batches 1,32,128 --decode-gemm auto \
    --out "$OUT/engine-auto.json" > "$OUT/engine-auto.log" 2>&1
echo "bench engine --decode-gemm auto: rc=$?"; grep -E "decode GEMMs|public workload" "$OUT/engine-auto.log"
python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print('skinny tuning at start (s):',
    {m: round(e.get('skinny_tune_s', 0), 2) for m, e in r['models'].items()})" "$OUT/engine-auto.json"
python3 scripts/device/summary.py "$OUT/engine-cublas.json" "$OUT/engine-triton.json" \
    "$OUT/engine-auto.json"
