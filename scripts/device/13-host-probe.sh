#!/usr/bin/env bash
# Device (one `run` call, ~7 min): the largest-shape LoRA run of 3-largest-lora.sh with every
# switch action watched by host_probe.py (wall, host, thread CPU, gc, context switches, steal,
# CPUs, the host's speed right before): the 32B once on an H200 whose /dev/shm holds it, else
# the 14B (and again held on PIN's CPUs, where PIN is set: 4-11) (issue 31: the sync, sleep
# and wake took one of two times a step).
#   bash scripts/device/13-host-probe.sh           (repo root, on the GPU machine; logs in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/device-env.sh || exit 1
shm_free=$(df --output=avail -B1 /dev/shm | tail -1)
if [ "${PRESET:-auto}" = auto ] && [ "$HW" = h200 ] && [ "$shm_free" -gt 72000000000 ]; then
    preset=qwen3-32b; dir=/dev/shm/qwen3-32b; pins=""; STEPS=${STEPS:-3}; RUN_TIMEOUT=${RUN_TIMEOUT:-330}
else
    preset=qwen3-14b; dir=/tmp/qwen3-14b; pins="${PIN:-}"; STEPS=${STEPS:-5}; RUN_TIMEOUT=${RUN_TIMEOUT:-220}
fi
[ -f $dir/config.json ] || timeout 200 python3 -m handoff init-model \
    --preset $preset --out $dir --device cuda > "$OUT/init.log" 2>&1
echo "init-model $preset: rc=$? ($(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo))"
for pin in "" $pins; do
    name=probe-$preset${pin:+-pin}
    rm -rf "/tmp/$name"
    timeout $RUN_TIMEOUT python3 scripts/device/host_probe.py ${pin:+--pin $pin} \
        --json "$OUT/$name.json" -- examples/h200-4b.yaml model.path=$dir \
        actor.lora.rank=16 run.steps=$STEPS run.checkpoint=false rollout.kv_pool=elastic \
        hardware.name=$HW run.out_dir="/tmp/$name" > "$OUT/$name.log" 2>&1
    echo "== $name (pin: ${pin:-none}): rc=$?"
    cp "/tmp/$name/summary.md" "$OUT/$name-summary.md" 2>/dev/null
    grep -E "^\| *(action|optimizer|engine|kv_cache|switch)" "/tmp/$name/summary.md" 2>/dev/null
    grep -A40 "^action  " "$OUT/$name.log" | grep -v "^$"
done
