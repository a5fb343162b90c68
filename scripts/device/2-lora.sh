#!/usr/bin/env bash
# Device round 2 (one `run` call, < 10 min): a Qwen3-8B shape with LoRA, the base shared vs
# held twice (3 steps each, elastic pool; issue 31), then the public workload with the
# sampler inside and outside the decode graphs, prefill and decode apart (issue 32: on
# 2026-12-05 the prefill took 1.13 s inside against 0.49 s outside).
#   bash scripts/device/2-lora.sh                  (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
timeout 80 python3 -m handoff init-model --preset qwen3-8b --out /tmp/qwen3-8b --device cuda \
    > "$OUT/init-8b.log" 2>&1
for share in true false; do
    timeout 160 python3 -m handoff train examples/h200-4b.yaml model.path=/tmp/qwen3-8b actor.lora.rank=16 \
        actor.lora.share_base=$share run.steps=3 run.checkpoint=false rollout.kv_pool=elastic \
        run.out_dir="$OUT/lora-8b-share-$share" > "$OUT/lora-8b-share-$share.log" 2>&1
    echo "8B LoRA share_base=$share: rc=$?"
    tail -30 "$OUT/lora-8b-share-$share/summary.md" 2>/dev/null | grep -E "^\|" | head -24
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| 8B LoRA | KV pool GB | gen s | step s (median of 2, 3) |")
print("|---|---|---|---|")
for share in ("true", "false"):
    path = Path(sys.argv[1]) / f"lora-8b-share-{share}" / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    if len(rows) < 3:
        print(f"| share_base={share} | - | - | - |"); continue
    kv = max(r["engine/kv_bytes"] for r in rows) / 1e9
    gen = sorted(r["timing_s/gen"] for r in rows[1:])[0]
    step = sorted(r["timing_s/step"] for r in rows[1:])[0]
    print(f"| share_base={share} | {kv:.1f} | {gen:.2f} | {step:.2f} |")
PY
for mode in --graph-sampling --no-graph-sampling; do
    timeout 90 python3 -m handoff bench engine --models "" --skip-hf $mode \
        --out "$OUT/public$mode.json" > "$OUT/public$mode.log" 2>&1
    echo "public workload $mode: rc=$?"
    python3 -c "import json, sys; p = json.load(open(sys.argv[1]))['public']; print(
        f\"prefill {p['prefill_s']:.2f} s, {p['ms_per_step']:.2f} ms/step, {p['tokens_per_s']:.0f} tok/s\")" \
        "$OUT/public$mode.json"
done
