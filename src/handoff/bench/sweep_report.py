"""The sweep's files for people: sweep.md (the source's table, planned beside measured) and
sweep.png (generation time and KV pool against utilization, the exclusive card, the boundary).

    write_report(json.loads(Path("sweep/sweep.json").read_text()), Path("sweep"))
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO

from handoff.safe_files import replace_file

GB = 1e9


def _seconds(value) -> str:
    """A measured time, or '-' where the point has none (the engine alone has no step)."""
    return "-" if value is None else f"{value:.2f}"


def _cell(planned: float | None, measured: float | None, fmt: str, scale: float = 1.0) -> str:
    def one(v):
        return "-" if v is None else format(v / scale, fmt)
    return f"{one(planned)} / {one(measured)}"


def _ratio(planned: float | None, measured: float | None) -> str:
    return f"{measured / planned:.2f}" if planned and measured else "-"


def _rows(state: dict) -> list[tuple[str, dict]]:
    points = sorted(state["points"].items(), key=lambda kv: (kv[1]["offloads"], kv[1]["util"]))
    if state.get("exclusive"):
        points.append(("exclusive card", state["exclusive"]))
    return points


def markdown(state: dict) -> str:
    lines = [f"# Utilization sweep: {state['model']}", "",
             f"`handoff bench sweep {state['config']} {' '.join(state['overrides'])}`, "
             f"{state['steps']} steps a point (medians of the steps after the first). Cells: "
             "planned / measured; planned = the planner (`plan.kvpool`) at the run's measured "
             "rates and workload.", "",
             "| point | KV GB | concurrency | decode ms | tokens/s | generation s | gen "
             "measured/planned | preemptions | step s | switch s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, p in _rows(state):
        m, plan = p["measured"], p.get("planned", {})
        if m["status"] != "ok":
            what = "out of memory" if m["status"] == "out_of_memory" else "error"
            owner = f": {m['owner']}" if m.get("owner") else ""
            lines.append(f"| {label} | {what}{owner} | {m['message'][:120]} |||||||| ")
            continue
        lines.append(
            f"| {label} | {_cell(plan.get('kv_pool_bytes'), m['kv_pool_bytes'], '.1f', GB)} "
            f"| {_cell(plan.get('concurrency'), m['peak_running'], '.0f')} "
            f"| {_cell(plan.get('decode_step_seconds'), m['decode_step_seconds'], '.1f', 1e-3)} "
            f"| {_cell(plan.get('tokens_per_second'), m['tokens_per_second'], '.0f')} "
            f"| {_cell(plan.get('generation_seconds'), m['generation_seconds'], '.2f')} "
            f"| {_ratio(plan.get('generation_seconds'), m['generation_seconds'])} "
            f"| {m['preemptions']:.0f} | {_seconds(m.get('step_seconds'))} "
            f"| {_seconds(m.get('switch_seconds'))} |")
    exclusive = (state.get("exclusive") or {}).get("measured", {})
    base = exclusive.get("generation_seconds") if exclusive.get("status") == "ok" else None
    if base:
        lines += ["", "Tax against the exclusive card (generation time / the engine alone's):"]
        for label, p in sorted(state["points"].items(), key=lambda kv: kv[1]["util"]):
            g = p["measured"].get("generation_seconds")
            if g:
                lines.append(f"- {label}: {g / base:.2f}x")
    for name, b in state.get("boundary", {}).items():
        lines += ["", f"Boundary of `{name}`: utilization {b['util']:.2f} does not fit "
                      f"({b['owner']}): {b['message']}"]
    return "\n".join(lines) + "\n"


def plot(state: dict, path: Path | BinaryIO) -> Path | BinaryIO:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gen, ax_kv) = plt.subplots(1, 2, figsize=(12, 4.4))
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    sets = sorted({p["offloads"] for p in state["points"].values()})
    for color, name in zip(colors, sets):
        ok = sorted((p for p in state["points"].values()
                     if p["offloads"] == name and p["measured"]["status"] == "ok"),
                    key=lambda p: p["util"])
        utils = [p["util"] for p in ok]
        ax_gen.plot(utils, [p["measured"]["generation_seconds"] for p in ok], "o-", color=color,
                    label=f"{name}: measured")
        ax_kv.plot(utils, [p["measured"]["kv_pool_bytes"] / GB for p in ok], "o-", color=color,
                   label=f"{name}: measured")
        planned = [p for p in ok if p.get("planned", {}).get("generation_seconds")]
        ax_gen.plot([p["util"] for p in planned],
                    [p["planned"]["generation_seconds"] for p in planned], "--", color=color,
                    alpha=0.7, label=f"{name}: planned")
        ax_kv.plot([p["util"] for p in planned],
                   [p["planned"]["kv_pool_bytes"] / GB for p in planned], "--", color=color,
                   alpha=0.7, label=f"{name}: planned")
        boundary = state.get("boundary", {}).get(name)
        if boundary:
            for ax in (ax_gen, ax_kv):
                ax.axvline(boundary["util"], color=color, linestyle=":", linewidth=1.2)
            ax_gen.annotate(f"out of memory ({boundary['owner']})", (boundary["util"], 0),
                            xycoords=("data", "axes fraction"), xytext=(3, 6),
                            textcoords="offset points", fontsize=7, rotation=90, color=color)
    exclusive = (state.get("exclusive") or {}).get("measured", {})
    if exclusive.get("status") == "ok":
        ax_gen.axhline(exclusive["generation_seconds"], color="black", linewidth=1,
                       label="engine alone (exclusive card)")
        ax_kv.axhline(exclusive["kv_pool_bytes"] / GB, color="black", linewidth=1,
                      label="engine alone (exclusive card)")
    ax_gen.set_xlabel("gpu_memory_utilization")
    ax_gen.set_ylabel("generation time per step, s")
    ax_gen.set_ylim(0, ax_gen.get_ylim()[1] * 1.35)   # room above a flat curve for the legend
    ax_kv.set_xlabel("gpu_memory_utilization")
    ax_kv.set_ylabel("KV pool, GB")
    ax_kv.set_ylim(bottom=0)
    for ax in (ax_gen, ax_kv):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left" if ax is ax_gen else "upper left")
    fig.suptitle(f"{state['model']}: the real cost of colocation, planned and measured")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def write_report(state: dict, out: Path) -> None:
    """sweep.md and sweep.png in `out`, never through a link planted there."""
    replace_file(out / "sweep.md", markdown(state).encode(), out)
    picture = io.BytesIO()
    plot(state, picture)
    replace_file(out / "sweep.png", picture.getvalue(), out)
