"""The utilization sweep as a picture: KV pool and generation time per gpu_memory_utilization.

    plot_utilization(build_plan(cfg), "kv-sweep.png")      # `handoff plan ... --plot FILE`

The source's point in one figure: the engine fixes its KV pool from the utilization at start,
so every step's generation time depends on it; the requested and the highest safe
utilization are marked. matplotlib is imported here only (no torch: plan/ runs anywhere).
"""

from __future__ import annotations

from pathlib import Path

GB = 1e9


def plot_utilization(report: dict, path: str | Path) -> Path:
    """Write the sweep of `report["kv"]` (a `build_plan` dict) to a PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["kv"], key=lambda r: r["utilization"])
    util = [r["utilization"] for r in rows]
    fig, (ax_kv, ax_gen) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_kv.bar(util, [r["kv_pool_bytes"] / GB for r in rows], width=0.035, color="#c44e52")
    ax_kv.set_xlabel("gpu_memory_utilization")
    ax_kv.set_ylabel("KV pool per card, GB", color="#c44e52")
    ax_c = ax_kv.twinx()
    ax_c.plot(util, [r["concurrency"] for r in rows], "o-", color="#4c72b0")
    ax_c.set_ylabel("concurrent sequences c", color="#4c72b0")
    ax_c.set_ylim(bottom=0)
    # No sequence fits a pool at that utilization (a plan that does not fit): no point.
    gen = [r["generation_seconds"] if r["generation_seconds"] is not None else float("nan")
           for r in rows]
    ax_gen.plot(util, gen, "o-", color="#55a868")
    ax_gen.set_xlabel("gpu_memory_utilization")
    ax_gen.set_ylabel("generation time per step, s")
    ax_gen.set_ylim(bottom=0)
    for r in rows:
        for flag, style, label in (("requested", "--", "requested"), ("best", ":", "highest safe")):
            if r.get(flag):
                for ax in (ax_kv, ax_gen):
                    ax.axvline(r["utilization"], linestyle=style, color="black", linewidth=1)
                ax_gen.annotate(f"{label} {r['utilization']:g}",
                                (r["utilization"], r["generation_seconds"] or 0.0),
                                textcoords="offset points", xytext=(4, 8), fontsize=8)
    model, layout = report["model"], report["layout"]
    fig.suptitle(f"{model['name']} on {layout['gpus']} x {report['hardware']['name']}, "
                 f"engine TP {layout['tp']}: the KV pool tax")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
