#!/usr/bin/env bash
# Device round 1 (one `run` call, < 10 min): the cuda tests, the checkpoint written under the
# device's Python, and the decode step with the sampler outside / inside the graphs (each run
# also prints the decode GEMM library chosen per batch size, with both libraries' times).
#   bash scripts/device/1-tests-and-decode.sh      (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
timeout 250 python3 -m pytest -q -m cuda -p no:cacheprovider > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: rc=$? $(tail -1 "$OUT/cuda-tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/cuda-tests.log" | cut -c1-220 | head -20
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_checkpoint_pythons.py \
    > "$OUT/pythons.log" 2>&1
echo "checkpoint under this Python: rc=$? $(tail -1 "$OUT/pythons.log")"
for mode in --no-graph-sampling --graph-sampling; do
    timeout 130 handoff bench engine --models qwen3-1.7b --batches 1,32,256 --skip-hf \
        --public-seqs 256 $mode --out "$OUT/engine${mode}.json" > "$OUT/engine${mode}.log" 2>&1
    echo "bench engine $mode: rc=$?"
done
python3 scripts/device/summary.py "$OUT"/engine--*.json
