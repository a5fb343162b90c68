#!/usr/bin/env bash
# Device (one `run` call, ~5 min): the engine's two unmeasured switches, each off and on in the
# same call, plus cuBLAS's split-K reduce at decode sizes.
# 1. HANDOFF_LONGEST_FIRST (decode attention starts rows longest context first): the public
#    workload (Qwen3-0.6B shape, 256 sequences, lengths uniform in [100, 1024]), 0/1/0/1.
# 2. HANDOFF_FUSED_MERGE (the last split merges; no merge kernel): the 1.7B at batch 1 / 32,
#    where decode attention splits the context, 0/1.
# 3. The paged-decode and graph CUDA tests with both on; gemm_reduction_probe.py.
# Logs and JSON in $OUT/logs.tgz; a table printed last.
#   bash scripts/device/12-engine-checks.sh        (repo root, on the GPU machine)
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
for fm in 0 1; do
    i=$((i + 1)); name=qwen-$i-fused-merge-$fm
    HANDOFF_FUSED_MERGE=$fm timeout 100 python3 -m handoff bench engine --skip-hf --no-public \
        --models qwen3-1.7b --batches 1,32 --out "$L/$name.json" > "$L/$name.log" 2>&1
    echo "$name: rc=$?"
done
HANDOFF_LONGEST_FIRST=1 HANDOFF_FUSED_MERGE=1 timeout 150 python3 -m pytest -q -m cuda \
    tests/rollout/test_kernels_paged_decode.py tests/rollout/test_graphs_cuda.py \
    > "$L/tests.log" 2>&1
echo "paged decode + graphs cuda tests (both on): rc=$?"; tail -1 "$L/tests.log"
timeout 45 python3 scripts/device/gemm_reduction_probe.py > "$L/gemm.log" 2>&1
echo "gemm probe: rc=$?"; tail -16 "$L/gemm.log"
python3 - "$L" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    if "public" in r:
        p = r["public"]
        print(f"{f.stem:26s} public {p['tokens_per_s']:8.0f} tok/s  decode {p['ms_per_step']:.2f} "
              f"ms/step  {p['decode_over_floor']:.3f}x floor")
    for m, e in r["models"].items():
        print(f"{f.stem:26s} {m} " + "  ".join(
            f"b{x['batch']} {x['ms_per_step']:.3f} ms ({x['over_floor']:.2f}x)" for x in e["rows"]))
PY
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
