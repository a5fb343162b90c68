#!/usr/bin/env bash
# Device (one `run` call, ~3 min): the public workload (Qwen3-0.6B shape, 256 sequences,
# prompt and output lengths uniform in [100, 1024]) with decode attention starting rows in
# row order (the default) and longest context first (HANDOFF_LONGEST_FIRST=1), same card;
# then the paged-decode CUDA tests with it on. Logs in one archive, $OUT/logs.tgz.
#   bash scripts/device/10-longest-first.sh        (repo root, on the GPU machine)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"; L=$OUT/logs
source scripts/device-env.sh > /dev/null || exit 1
echo "card: $HW"
for order in 0 1 0 1; do
    HANDOFF_LONGEST_FIRST=$order timeout 120 python3 -m handoff bench engine --skip-hf \
        --models "" --out "$L/public-$order.json" > "$L/public-$order.log" 2>&1
    echo "longest first=$order: rc=$? $(grep -o 'public workload.*tok/s' "$L/public-$order.log" | tail -1)"
    grep -o 'decode [0-9.]*x its HBM floor' "$L/public-$order.log" | tail -1
done
HANDOFF_LONGEST_FIRST=1 timeout 120 python3 -m pytest -q -m cuda tests/rollout/test_kernels_paged_decode.py \
    tests/rollout/test_graphs_cuda.py > "$L/tests.log" 2>&1
echo "paged decode + graphs cuda tests: rc=$?"; tail -1 "$L/tests.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
