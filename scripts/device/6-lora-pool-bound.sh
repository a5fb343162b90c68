#!/usr/bin/env bash
# Device (one `run` call, < 9 min, sized for an 80 GB H100): the Qwen3-8B shape with LoRA on a
# rollout that fills the smaller pool (issue 31): 256 sequences x 1280 new tokens (~340K
# tokens of KV; a random-init model never samples EOS). The base shared (one copy: ~64 GB of
# pool, ~435K tokens) against held twice with both copies on the card (~39 GB, ~260K tokens:
# it must preempt); then the shared run's generation against its engine alone on the card.
#   bash scripts/device/6-lora-pool-bound.sh        (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
STEPS=${STEPS:-2}; RUN_TIMEOUT=${RUN_TIMEOUT:-200}; NEW=${NEW:-1280}
timeout 80 python3 -m handoff init-model --preset qwen3-8b --out /tmp/qwen3-8b --device cuda \
    > "$OUT/init-8b.log" 2>&1
WORKLOAD="rollout.max_tokens=$NEW rollout.max_model_len=$((NEW + 128)) workload.response_len=$NEW"
for setting in "true true" "false false"; do
    set -- $setting; share=$1; offload=$2
    timeout $RUN_TIMEOUT python3 -m handoff train examples/h200-4b.yaml model.path=/tmp/qwen3-8b \
        actor.lora.rank=16 actor.lora.share_base=$share memory.param_offload=$offload \
        actor.compile=false $WORKLOAD run.steps=$STEPS run.checkpoint=false rollout.kv_pool=elastic \
        hardware.name=$HW run.out_dir="$OUT/bound-share-$share" > "$OUT/bound-share-$share.log" 2>&1
    echo "8B LoRA share_base=$share param_offload=$offload: rc=$?"
    tail -3 "$OUT/bound-share-$share.log"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| 8B LoRA, pool bound | KV pool GB | peak running / preemptions | gen s | switch exposed s | step s |")
print("|---|---|---|---|---|---|")
for share in ("true", "false"):
    path = Path(sys.argv[1]) / f"bound-share-{share}" / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    for r in rows:
        print(f"| share_base={share} step {r['step']} | {r['engine/kv_bytes'] / 1e9:.1f} | "
              f"{r['engine/peak_running']} / {r['engine/preemptions']} | {r['timing_s/gen']:.2f} | "
              f"{r['switch/exposed_s']:.2f} | {r['timing_s/step']:.2f} |")
PY
timeout 150 python3 scripts/device/exclusive_engine.py "$OUT/bound-share-true" --steps $STEPS \
    > "$OUT/exclusive.log" 2>&1
echo "engine alone: rc=$?"; tail -6 "$OUT/exclusive.log"
