#!/usr/bin/env bash
# Device (one `run` call, ~4 min): a decode step's LoRA terms in Triton (the default: q/k/v's
# and gate/up's added by the fused kernels that read the products, o's and down's by
# kernels/fused.add_term) against cuBLAS's expand GEMMs (HANDOFF_LORA_FOLD=0): the fused-kernel,
# skinny and LoRA CUDA tests, then the 1.7B's decode with and
# without a rank-16 adapter at batch 1 / 32 / 128, off / on / off / on on the same card
# (issue 31: within 1.10x the base). Logs and JSON in $OUT/logs.tgz; a table printed last.
#   bash scripts/device/12-lora-fold.sh            (repo root, on the GPU machine)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"; L=$OUT/logs
source scripts/device-env.sh > /dev/null || exit 1
echo "card: $HW"
timeout 150 python3 -m pytest -q -m cuda tests/rollout/test_kernels_fused.py \
    tests/rollout/test_kernels_skinny.py tests/rollout/test_engine_lora_cuda.py > "$L/tests.log" 2>&1
echo "fused-kernel and engine cuda tests: rc=$?"; tail -1 "$L/tests.log"
grep -E "^(FAILED|ERROR)" "$L/tests.log" | cut -c1-200 | head -8
i=0
for fold in 0 1 0 1; do
    [ $SECONDS -gt ${STOP_AFTER:-470} ] && break   # within the call's 600 s
    i=$((i + 1)); name=lora-$i-fold-$fold
    HANDOFF_LORA_FOLD=$fold timeout 75 python3 -m handoff bench engine --skip-hf --no-public \
        --models qwen3-1.7b --batches 1,32,128 --lora-rank 16 --out "$L/$name.json" \
        > "$L/$name.log" 2>&1
    echo "$name: rc=$?"
done
python3 - "$L" <<'PY'
import json, pathlib, sys
print("| run | batch | base ms | LoRA r16 ms | LoRA x base | LoRA graph: kernels, GEMM ms, "
      "other ms |\n|---|---|---|---|---|---|")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    model = json.loads(f.read_text())["models"]["qwen3-1.7b"]
    for r, lr in zip(model["rows"], model["lora"]["rows"]):
        g = lr.get("graph_kernels", {})
        print(f"| {f.stem} | {r['batch']} | {r['ms_per_step']:.3f} | "
              f"{r['lora_ms_per_step']:.3f} | {r['lora_over_base']:.3f} | "
              f"{g.get('kernels')}, {g.get('gemm_ms', 0):.3f}, {g.get('other_ms', 0):.3f} |")
PY
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
