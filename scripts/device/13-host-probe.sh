#!/usr/bin/env bash
# Device (one `run` call, ~7 min on an H100): the 14B LoRA run of 3-largest-lora.sh with every
# switch action watched by host_probe.py (wall, host, thread CPU, gc, context switches, steal,
# CPUs, the host's speed right before), unpinned, then with the process held on PIN's CPUs
# (issue 31: the sync, sleep and wake take one of two times a step).
#   bash scripts/device/13-host-probe.sh           (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
STEPS=${STEPS:-5}; RUN_TIMEOUT=${RUN_TIMEOUT:-220}; PIN=${PIN:-4-11}
[ -f /tmp/qwen3-14b/config.json ] || timeout 120 python3 -m handoff init-model \
    --preset qwen3-14b --out /tmp/qwen3-14b --device cuda > "$OUT/init.log" 2>&1
echo "init-model: rc=$? ($(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo))"
for pin in "" $PIN; do
    name=probe${pin:+-pin}
    rm -rf "/tmp/$name"
    timeout $RUN_TIMEOUT python3 scripts/device/host_probe.py ${pin:+--pin $pin} \
        --json "$OUT/$name.json" -- examples/h200-4b.yaml model.path=/tmp/qwen3-14b \
        actor.lora.rank=16 run.steps=$STEPS run.checkpoint=false rollout.kv_pool=elastic \
        hardware.name=$HW run.out_dir="/tmp/$name" > "$OUT/$name.log" 2>&1
    echo "== $name (pin: ${pin:-none}): rc=$?"
    grep -E "^\| *(engine|kv_cache|switch)" "/tmp/$name/summary.md" 2>/dev/null
    grep -A40 "^action  " "$OUT/$name.log" | grep -v "^$"
done
