#!/usr/bin/env bash
# Device round 2 (one `run` call, < 9 min): a Qwen3-8B shape with LoRA, the base shared vs
# held twice (3 steps each, elastic pool; issue 31): the KV pool, generation and the step;
# then the shared run's generation against the same engine alone on the card, its pool.
#   bash scripts/device/2-lora.sh                  (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
STEPS=${STEPS:-3}; RUN_TIMEOUT=${RUN_TIMEOUT:-150}   # a shorter call: STEPS=2 RUN_TIMEOUT=110
timeout 80 python3 -m handoff init-model --preset qwen3-8b --out /tmp/qwen3-8b --device cuda \
    > "$OUT/init-8b.log" 2>&1
for share in true false; do
    timeout $RUN_TIMEOUT python3 -m handoff train examples/h200-4b.yaml model.path=/tmp/qwen3-8b actor.lora.rank=16 \
        actor.lora.share_base=$share run.steps=$STEPS run.checkpoint=false rollout.kv_pool=elastic hardware.name=$HW \
        run.out_dir="$OUT/lora-8b-share-$share" > "$OUT/lora-8b-share-$share.log" 2>&1
    echo "8B LoRA share_base=$share: rc=$?"
    tail -30 "$OUT/lora-8b-share-$share/summary.md" 2>/dev/null | grep -E "^\|" | head -24
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| 8B LoRA | KV pool GB | peak running / preemptions | gen s | switch exposed s | step s |")
print("|---|---|---|---|---|---|")
for share in ("true", "false"):   # after step 1 (it builds kernels): the fastest step
    path = Path(sys.argv[1]) / f"lora-8b-share-{share}" / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    if len(rows) < 2:
        print(f"| share_base={share} | - | - | - | - | - |"); continue
    kv = max(r["engine/kv_bytes"] for r in rows) / 1e9
    best = min(rows[1:], key=lambda r: r["timing_s/step"])
    print(f"| share_base={share} | {kv:.1f} | {best['engine/peak_running']} / "
          f"{best['engine/preemptions']} | {best['timing_s/gen']:.2f} | "
          f"{best['switch/exposed_s']:.2f} | {best['timing_s/step']:.2f} |")
PY
timeout 120 python3 scripts/device/exclusive_engine.py "$OUT/lora-8b-share-true" --steps 3 \
    > "$OUT/exclusive.log" 2>&1
echo "engine alone: rc=$?"; tail -6 "$OUT/exclusive.log"
