#!/usr/bin/env bash
# Device (one `run` call, ~4 min): the public workload (Qwen3-0.6B shape, 256 sequences, prompt
# and output lengths uniform in [100, 1024]) with decode attention starting the rows' programs
# in row order (HANDOFF_LONGEST_FIRST=0) and longest context first (the default), 0/1/0/1 on
# the same card; the paged-decode and graph CUDA tests; gemm_reduction_probe.py (cuBLAS's
# split-K reduce at decode sizes). Logs and JSON in $OUT/logs.tgz; a table printed last.
#   bash scripts/device/10-longest-first.sh        (repo root, on the GPU machine)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"; L=$OUT/logs
source scripts/device-env.sh > /dev/null || exit 1
echo "card: $HW"
i=0
for lf in 0 1 0 1; do
    i=$((i + 1)); name=public-$i-longest-first-$lf
    HANDOFF_LONGEST_FIRST=$lf timeout 100 python3 -m handoff bench engine --skip-hf \
        --models "" --out "$L/$name.json" > "$L/$name.log" 2>&1
    echo "$name: rc=$?"
done
timeout 150 python3 -m pytest -q -m cuda tests/rollout/test_kernels_paged_decode.py \
    tests/rollout/test_graphs_cuda.py > "$L/tests.log" 2>&1
echo "paged decode + graphs cuda tests: rc=$?"; tail -1 "$L/tests.log"
timeout 45 python3 scripts/device/gemm_reduction_probe.py > "$L/gemm.log" 2>&1
echo "gemm probe: rc=$?"; tail -16 "$L/gemm.log"
python3 - "$L" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    p = json.loads(f.read_text())["public"]
    print(f"{f.stem:26s} {p['tokens_per_s']:8.0f} tok/s  decode {p['ms_per_step']:.2f} ms/step  "
          f"{p['decode_over_floor']:.3f}x floor")
PY
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
