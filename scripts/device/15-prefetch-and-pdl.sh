#!/usr/bin/env bash
# Device (one `run` call, ~8.5 min with MODELS=qwen3-1.7b): two launch-level changes to the
# decode step (issue 32), the L2 prefetch of the next weights (kernels/prefetch.py) and PDL
# for the small kernels (kernels/pdl.py). l2_prefetch_probe.py (a Qwen3-shaped stack in one
# graph, each plan against none); the engine's CUDA test (tokens bit-equal with either) and
# its LoRA CUDA tests under PDL (the term kernels launch with it); then the engine's decode
# at batch 1 and 32 on MODELS (default the 1.7B and 4B shapes) with neither, the prefetch
# (PLAN, default o+gu16), PDL, and both; the public workload without and with PDL. The
# engine's runs come first so a call cut short keeps them. Logs and JSON in $OUT/logs.tgz; a
# table printed last.
#   [MODELS=qwen3-1.7b] [PLAN=o+gu16] bash scripts/device/15-prefetch-and-pdl.sh  (repo root)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"; L=$OUT/logs
source scripts/device-env.sh > /dev/null || exit 1
PLAN=${PLAN:-o+gu16}; MODELS=${MODELS:-qwen3-1.7b,qwen3-4b}
echo "card: $HW"
timeout 90 python3 -m pytest -q -m cuda tests/rollout/test_engine_cuda.py -k prefetch \
    > "$L/tests.log" 2>&1
echo "prefetch + pdl cuda test: rc=$?"; tail -1 "$L/tests.log"
i=0
for both in 0:0 "$PLAN":0 0:1 "$PLAN":1; do
    plan=${both%:*}; pdl=${both#*:}
    i=$((i + 1)); name=engine-$i-prefetch-${plan//+/-}-pdl-$pdl
    HANDOFF_L2_PREFETCH=$plan HANDOFF_PDL=$pdl timeout 120 python3 -m handoff bench engine \
        --skip-hf --no-public \
        --models "$MODELS" --batches 1,32 --out "$L/$name.json" > "$L/$name.log" 2>&1
    echo "$name: rc=$?"
done
for pdl in 0 1; do
    name=public-pdl-$pdl
    HANDOFF_PDL=$pdl timeout 100 python3 -m handoff bench engine --skip-hf --models "" \
        --out "$L/$name.json" > "$L/$name.log" 2>&1
    echo "$name: rc=$?"
done
HANDOFF_PDL=1 timeout 150 python3 -m pytest -q -m cuda tests/rollout/test_engine_lora_cuda.py \
    > "$L/lora-tests.log" 2>&1
echo "lora cuda tests under pdl: rc=$?"; tail -1 "$L/lora-tests.log"
timeout 100 python3 scripts/device/l2_prefetch_probe.py > "$L/probe.log" 2>&1
echo "probe: rc=$?"
grep -E 'copy rate| ms \(|Error' "$L/probe.log"
python3 - "$L" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("public-*.json")):
    p = json.loads(f.read_text())["public"]
    print(f"{f.stem:30s} {p['tokens_per_s']:8.0f} tok/s  decode {p['ms_per_step']:.2f} ms/step  "
          f"{p['decode_over_floor']:.3f}x floor")
for f in sorted(pathlib.Path(sys.argv[1]).glob("engine-*.json")):
    for model, entry in json.loads(f.read_text())["models"].items():
        for r in entry["rows"]:
            print(f"{f.stem:30s} {model:11s} b{r['batch']:<3d} {r['ms_per_step']:.3f} ms "
                  f"{r['over_floor']:.2f}x floor")
PY
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
