"""One table from `handoff bench engine` JSON files: step, floors, prefill, GEMM backend.

    python3 scripts/device/summary.py engine-a.json engine-b.json
"""

import json
import sys

print("| file | model | batch | ms/step | x floor | x roofline | prefill % peak | last step x "
      "its floor | attn TB/s | GEMM lib | draw ms torch / fused | LoRA x base |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    result = json.load(open(path))
    for model, entry in result["models"].items():
        libs = entry.get("decode_gemm") or {}
        for r in entry["rows"]:
            k = r.get("graph_kernels") or {}
            attn = k.get("attention_bytes_per_s")
            lib = next((libs[b] for b in sorted(libs, key=int) if int(b) >= r["batch"]), "-")
            d = r.get("draw_ms") or {}
            draws = f"{d['torch']:.3f} / {d['fused']:.3f}" if d else "-"
            print(f"| {path.rsplit('/', 1)[-1]} | {model} | {r['batch']} | {r['ms_per_step']:.2f} "
                  f"| {r['over_floor']:.2f} | {r['over_roofline']:.2f} "
                  f"| {100 * r['prefill_of_peak']:.0f}% | {k.get('kernel_over_floor', 0):.2f} "
                  f"| {attn / 1e12 if attn else 0:.2f} | {lib} | {draws} "
                  f"| {r.get('lora_over_base', 0):.2f} |")
    pub = result.get("public")
    if pub:
        print(f"public workload ({path.rsplit('/', 1)[-1]}): {pub['tokens_per_s']:.0f} tok/s, "
              f"{pub['ms_per_step']:.2f} ms/step, host {pub['host_ms_per_step']:.2f} ms, "
              f"prefill {pub['prefill_s']:.2f} s (first of its shapes "
              f"{pub.get('first_prefill_s', float('nan')):.2f} s), decode "
              f"{pub.get('decode_over_floor') or float('nan'):.2f}x its floor")
