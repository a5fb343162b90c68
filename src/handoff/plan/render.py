"""Print a `build_plan` report: rich tables for a terminal, or Markdown for docs.

Both forms come from one list of (title, header, rows) so they never disagree; numbers are
shown in GB (1e9 bytes), seconds and milliseconds, while `--json` keeps bytes and seconds
(and a utilization or KV pool at or below 0, which is printed as "none").
"""

from __future__ import annotations

from handoff.plan.advice import advice_text

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def _util(x: float | None) -> str:
    """A utilization; at or below 0 (nothing is safe) there is none to give."""
    return f"{x:.2f}" if x is not None and x > 0 else "none"


def _pool_gb(x: float) -> str:
    """A KV pool in GB; a negative one is the engine's shortfall, no pool."""
    return _gb(x) if x > 0 else f"none ({_gb(-x)} short)"


def _secs(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.0f}"


def header_lines(report: dict) -> list[str]:
    m, lay, wl, hw = report["model"], report["layout"], report["workload"], report["hardware"]
    moe = (f", MoE {m['experts']} experts, {m['active_params'] / 1e9:.1f}B active"
           if m["experts"] else "")
    off = report["offload"]
    flags = ", ".join(f"{k} offload {'on' if off[k] else 'off'}" for k in ("param", "optimizer"))
    ref = "no ref"
    lora = report.get("lora")
    if off["ref"]:
        ref = ("ref: the base with the adapters off" if lora else
               "ref offloaded" if off["ref_offload"] else "ref kept on card")
    lines = [
        f"model {m['name']}: {m['params'] / 1e9:.2f}B params{moe}, "
        f"KV {m['kv_bytes_per_token'] / 1024:.0f} KiB/token",
        f"{lay['gpus']} x {hw['name']} ({_gb(hw['hbm_bytes'])} GB HBM, pinned PCIe "
        f"{hw['pinned_pcie_bps'] / GB:.0f} GB/s), FSDP shard {lay['shard_size']}, engine TP "
        f"{lay['tp']}{' (auto)' if lay['tp_auto'] else ''}; {flags}, {ref}",
        f"workload: P={wl['prompt_len']}, L={wl['response_len']}, gpu_memory_utilization="
        f"{wl['utilization']:g}",
    ]
    if lora:
        lines.append(f"LoRA rank {lora['rank']} (alpha {lora['alpha']:g}) on "
                     f"{', '.join(lora['target_modules'])}: {lora['adapter_params'] / 1e6:.1f}M "
                     f"adapter params ({_gb(lora['adapter_bytes'])} GB); the base "
                     f"({_gb(lora['base_bytes'])} GB) "
                     + ("held once per card: the engine's weights, the trainer's frozen base "
                        "and the reference" if lora.get("share_base", True) else
                        "held twice (actor.lora.share_base=false): the trainer's own, and the "
                        "engine's, backed up to pinned host memory at each sleep"))
    lines += [f"assumed: {a}" for a in wl["assumed"]]
    return lines


def tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    train, gen = report["memory"]["train"], report["memory"]["generate"]
    t_items, g_items = list(train.items()), list(gen.items())
    mem_rows = []
    for i in range(max(len(t_items), len(g_items))):
        t = t_items[i] if i < len(t_items) else ("", None)
        g = g_items[i] if i < len(g_items) else ("", None)
        gen_gb = "" if g[1] is None else _pool_gb(g[1]) if g[0] == "kv_pool" else _gb(g[1])
        mem_rows.append([t[0], _gb(t[1]) if t[1] is not None else "", g[0], gen_gb])
    mem_rows.append(["training peak (limit)", f"{_gb(report['memory']['train_peak_bytes'])} "
                     f"({_gb(report['memory']['train_peak_limit_bytes'])})", "", ""])

    sw = report["switch"]
    act_rows = [[str(i + 1), a["name"], a["direction"], _gb(a["bytes_per_card"]), a["link"],
                 _secs(a["seconds"]), _secs(a["exposed_seconds"]), a["note"]]
                for i, a in enumerate(sw["actions"])]
    share = (f"{sw['share_of_step']:.2%} of step" if sw["share_of_step"] is not None
             else "step unknown")
    act_rows.append(["", "total", "", _gb(sw["total_bytes_per_card"]), "PCIe moves",
                     _secs(sw["total_seconds"]), _secs(sw["exposed_seconds"]), share])

    kv_rows = []
    for r in report["kv"]:
        asked = "elastic pool" if report["workload"].get("kv_pool") == "elastic" else "requested"
        mark = ", ".join(x for x, on in ((asked, r["requested"]), ("highest safe", r["best"]))
                         if on)
        gen_s = _secs(r["generation_seconds"]) if r["generation_seconds"] is not None else "-"
        kv_rows.append([f"{r['utilization']:g}", _pool_gb(r["kv_pool_bytes"]),
                        f"{r['concurrency']:.0f}",
                        f"{r['decode_step_seconds'] * 1e3:.1f}", f"{r['tokens_per_second']:.0f}",
                        gen_s, mark])
    out = [
        ("Memory per card by owner (GB)", ["training", "GB", "generation", "GB"], mem_rows),
        ("The nine switch actions, per card (exposed: the seconds the step waits for)",
         ["#", "action", "dir", "GB", "link", "s", "exposed s", "note"], act_rows),
        ("KV pool vs gpu_memory_utilization",
         ["util", "KV GB", "c", "decode ms", "tok/s/card", "gen s", ""], kv_rows),
    ]
    options = report.get("offload_sets")
    if options:
        rows = []
        for o in options["sets"]:
            if not o.get("kv_pool_bytes") or o["kv_pool_bytes"] <= 0 or not o["fits"]:
                rows.append([o["offloads"], _util(o["utilization"]), "-", "-", "-", "-",
                             "does not fit"])
                continue
            rows.append([o["offloads"], f"{o['utilization']:.2f}", _gb(o["kv_pool_bytes"]),
                         _secs(o["generation_seconds"]), _secs(o["switch_seconds"]),
                         _secs(o["step_seconds"]),
                         "recommended" if o["offloads"] == options["recommended"] else ""])
        out.append(("Offload sets, each at its highest safe utilization",
                    ["offloads", "util", "KV GB", "gen s", "switch s (exposed)",
                     "step s (modelled)", ""], rows))
    return out


def summary_lines(report: dict) -> list[str]:
    lines = []
    gain = report["kv_gain"]
    if gain and round(gain["slower_by"], 2) > 0:
        lines.append(f"generation at {gain['from_utilization']:g} takes {gain['slower_by']:.0%} "
                     f"longer than at the highest safe {gain['to_utilization']:g} "
                     f"({gain['seconds_saved']:.0f} s per step)")
    elif gain and round(gain["slower_by"], 2) < 0:   # asked above the safe one: see the verdict
        lines.append(f"generation at {gain['from_utilization']:g} is {-gain['slower_by']:.0%} "
                     f"faster than at the highest safe {gain['to_utilization']:g} "
                     f"({-gain['seconds_saved']:.0f} s less per step), above what is safe")
    wl = report["workload"]
    if wl.get("kv_pool") == "elastic":
        row = next(r for r in report["kv"] if r["requested"])
        lines.append(f"elastic KV pool: {_gb(row['kv_pool_bytes'])} GB at each wake (what the "
                     f"trainer leaves, {wl['utilization']:.0%} of the card, less the engine's "
                     "weights, activations and graphs); no gpu_memory_utilization to choose")
    cap = report["workload"]["max_num_seqs"]
    capped = [r["utilization"] for r in report["kv"] if r["concurrency"] >= cap]
    if capped:
        lines.append(f"concurrency is capped by rollout.max_num_seqs={cap} from utilization "
                     f"{min(capped):g} up: raise it (rollout.max_num_seqs=1024) to use that pool")
    lay = report["layout"]
    fits = report["pinned_host_fits"]
    lines.append(f"pinned host RAM: {_gb(report['pinned_host_bytes_per_card'])} GB per card x "
                 f"{lay['cards_per_node']} cards = {_gb(report['pinned_host_bytes_per_node'])} GB "
                 f"per node of {_gb(report['host_ram_bytes'])} GB "
                 f"({'fits' if fits else 'does not fit'} in half of it)")
    st = report["step"]
    if st["modelled_seconds"] is not None:
        given = f"; given {_secs(st['seconds'])} s" if st["source"] == "given" else ""
        lines.append(f"step: generation {_secs(st['generation_seconds'])} s + switch "
                     f"{_secs(st['switch_seconds'])} s exposed + training "
                     f"{_secs(st['train_seconds'])} s "
                     f"({st['train_flops_per_s'] / 1e12:.0f} TFLOP/s per card) = "
                     f"{_secs(st['modelled_seconds'])} s modelled{given}")
    if report.get("compile"):   # actor.compile as the run would decide it (plan/compile.py)
        c = report["compile"]
        lines.append(f"compiled layers: {'on' if c['on'] else 'off'} ({c['reason']})")
    v = report["verdict"]
    util = _util(v["max_utilization"])
    lines.append(f"verdict: {'fits' if v['fits'] else 'DOES NOT FIT'}; mode "
                 f"{v['mode'] or '-'}; highest safe gpu_memory_utilization {util}")
    lines += [f"  - {r}" for r in v["reasons"]]
    if not v.get("runnable", True):
        lines.append("to fit: no layout helps: the runtime cannot run this model (see the "
                     "first reason); the tables size it for another trainer")
    elif report.get("lora"):
        if report["lora"]["to_fit"]:
            lines.append(f"to fit: {report['lora']['to_fit']}")
        lines.append(f"LoRA: {report['lora']['advice']}")
    elif not v["fits"]:
        lines.append(f"to fit: {advice_text(v.get('advice'))}")
    options = report.get("offload_sets")
    if options and options["recommended"]:
        o = next(x for x in options["sets"] if x["offloads"] == options["recommended"])
        now = report["offload"]
        lines.append(f"recommended offloads: {o['offloads']} at gpu_memory_utilization "
                     f"{o['utilization']:.2f} ({_secs(o['step_seconds'])} s a step modelled; the "
                     f"trainer's compute is the same for every set; now: param "
                     f"{now['param']}, optimizer {now['optimizer']}, ref {now['ref_offload']})")
    return lines


def render_markdown(report: dict) -> str:
    out = [f"{line}  " for line in header_lines(report)]
    for title, head, rows in tables(report):
        out += ["", f"**{title}**", "", "| " + " | ".join(head) + " |",
                "|" + "|".join("---" for _ in head) + "|"]
        out += ["| " + " | ".join(row) + " |" for row in rows]
    out += [""] + [line if line.startswith("  -") else f"{line}  "
                   for line in summary_lines(report)]
    return "\n".join(out) + "\n"


def render_rich(report: dict, console) -> None:
    from rich.table import Table

    for line in header_lines(report):
        console.print(line, highlight=False, markup=False)   # a model's name is the user's
    for title, head, rows in tables(report):
        table = Table(title=title, title_justify="left")
        for h in head:
            # An action's name whole: the notes wrap instead.
            table.add_column(h, justify="right" if h in ("GB", "s", "exposed s", "KV GB", "c",
                                                         "decode ms", "tok/s/card", "gen s",
                                                         "#") else "left",
                             min_width=19 if h == "action" else None)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for line in summary_lines(report):
        console.print(line, highlight=False, soft_wrap=True, markup=False)
