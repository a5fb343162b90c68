#!/usr/bin/env bash
# Device (two `run` calls, ~5 min each, sized for an 80 GB H100): the Qwen3-8B shape with
# LoRA on a rollout that fills the smaller pool (issue 31): 256 sequences x 1280 new tokens
# (~350K tokens of KV; a random-init model never samples EOS). The base shared (one copy:
# ~64 GB of pool, ~435K tokens) against held twice with both copies on the card (~48 GB,
# ~326K tokens: it must preempt); then the shared run's generation against its engine alone
# on the card. A run starts in ~30 s and steps in ~85 s on an H100: two steps of both
# settings do not fit one call, so SETTINGS picks them ("share:param_offload" pairs) and
# EXCLUSIVE=0 skips the engine-alone comparison:
#   SETTINGS=true:true bash scripts/device/6-lora-pool-bound.sh    (repo root, on the GPU
#   SETTINGS=false:false EXCLUSIVE=0 bash scripts/device/6-lora-pool-bound.sh   machine; $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
STEPS=${STEPS:-2}; RUN_TIMEOUT=${RUN_TIMEOUT:-300}; NEW=${NEW:-1280}
SETTINGS=${SETTINGS:-"true:true false:false"}; EXCLUSIVE=${EXCLUSIVE:-1}
timeout 80 python3 -m handoff init-model --preset qwen3-8b --out /tmp/qwen3-8b --device cuda \
    > "$OUT/init-8b.log" 2>&1
WORKLOAD="rollout.max_tokens=$NEW rollout.max_model_len=$((NEW + 128)) workload.response_len=$NEW"
for setting in $SETTINGS; do
    share=${setting%%:*}; offload=${setting##*:}
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
for share in ("true", "false"):  # where each switch's time went, action by action
    path = Path(sys.argv[1]) / f"bound-share-{share}" / "metrics.jsonl"
    for r in [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []:
        acts = {k.split("/")[1]: v for k, v in r.items()
                if k.startswith("switch/") and k.endswith("/seconds") and v > 0.01}
        print(f"share_base={share} step {r['step']} switch actions > 10 ms:",
              ", ".join(f"{a} {v:.2f}s" for a, v in sorted(acts.items(), key=lambda kv: -kv[1])))
PY
[ "$EXCLUSIVE" = 1 ] && [ -d "$OUT/bound-share-true" ] || exit 0
timeout 150 python3 scripts/device/exclusive_engine.py "$OUT/bound-share-true" --steps $STEPS \
    > "$OUT/exclusive.log" 2>&1
echo "engine alone: rc=$?"; tail -6 "$OUT/exclusive.log"
