"""A finished run's generation against the planner's: calibrated, and at the HBM floor.

    python3 scripts/device/reasoning_floor.py RUN_DIR

The calibrated plan prices a decode step with the engine's measured step floor and
per-sequence cost (the sweep's "planned"); the HBM floor prices it as its bytes alone, the
weights and every running sequence's KV read once at the copy rate this run measured
(d2d_bps), no launches, no sampler, no host. Both simulate this run's response lengths step
by step (plan.kvpool.decode_timeline) at the pool of rollout.gpu_memory_utilization (0.5 when
unset, as under rollout.kv_pool=elastic): the reasoning workload's pool never binds there.
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from handoff.bench.sweep import planned_point
from handoff.calibrate import Rates
from handoff.config import load_config
from handoff.plan.hardware import hardware_profile

run = Path(sys.argv[1])
cfg = load_config(run / "config.json")
rates = json.loads((run / "summary.json").read_text())["rates"]
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
measured = statistics.median(r["timing_s/gen"] for r in rows)
prompt = statistics.mean(r["prompt_length"] for r in rows)
util = cfg.rollout.gpu_memory_utilization or 0.5
calibrated = planned_point(cfg, rates, util, prompt_len=prompt)["generation_seconds"]

# The floor: the profile's decode rates replaced by the measured copy rate, no fixed cost.
hw = Rates(rates).profile(hardware_profile(cfg.hardware.name, cfg.hardware))
floor_hw = dataclasses.replace(hw, decode_bw_bps=rates["d2d_bps"], kv_read_bps=rates["d2d_bps"],
                               decode_floor_s=0.0, decode_per_seq_s=0.0)
floor = planned_point(cfg, rates, util, prompt_len=prompt, hw=floor_hw)["generation_seconds"]
print(f"| generation s, median of {len(rows)} steps | calibrated plan | HBM floor "
      f"({rates['d2d_bps'] / 1e12:.2f} TB/s) | measured / plan | measured / floor |")
print("|---|---|---|---|---|")
print(f"| {measured:.2f} | {calibrated:.2f} | {floor:.2f} | {measured / calibrated:.2f} | "
      f"{measured / floor:.2f} |")
