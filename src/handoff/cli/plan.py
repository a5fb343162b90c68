"""`handoff plan`: the planner's report of a run, before anything is loaded."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from handoff.cli import PLAN_DOES_NOT_FIT, app, console, err_console, friendly_errors
from handoff.errors import HandoffError


@app.command("plan")
@friendly_errors
def plan_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help="config overrides key.sub=value"),
    model: Optional[str] = typer.Option(None, help="preset (qwen3-32b, ...), HF config dir or "
                                        "a Hub id org/name in the local HF cache"),
    gpus: Optional[int] = typer.Option(None, help="total cards"),
    hardware: Optional[str] = typer.Option(None, help="h100-sxm | h200 | a100-80g | cpu"),
    shard_size: Optional[int] = typer.Option(None, help="FSDP group (default: all cards)"),
    tp: Optional[int] = typer.Option(None, help="engine TP (default: auto, or the config's)"),
    util: Optional[float] = typer.Option(None, help="gpu_memory_utilization (default 0.5)"),
    param_offload: Optional[bool] = typer.Option(None, "--param-offload/--no-param-offload"),
    optimizer_offload: Optional[bool] = typer.Option(
        None, "--optimizer-offload/--no-optimizer-offload"),
    kl_coef: Optional[float] = typer.Option(None, "--kl-coef", help="actor.kl_coef: a "
                                            "reference model is planned only when > 0"),
    lora_rank: Optional[int] = typer.Option(None, "--lora-rank", help="actor.lora.rank: plan "
                                            "LoRA adapters of this rank on one copy of the base "
                                            "(0: full-parameter)"),
    ref_offload: Optional[bool] = typer.Option(None, "--ref-offload/--no-ref-offload"),
    grad_offload: bool = typer.Option(False, help="move grads with the optimizer, not free them"),
    prompt_len: Optional[int] = typer.Option(None, help="mean prompt tokens P"),
    response_len: Optional[int] = typer.Option(None, help="mean response tokens L"),
    max_response_len: Optional[int] = typer.Option(None, help="longest response (long tail)"),
    tokens_per_step: Optional[float] = typer.Option(None, help="generated tokens/step, all cards"),
    step_seconds: Optional[float] = typer.Option(None, help="measured step time (default: "
                                                 "generation + switch + training, modelled)"),
    host_ram_gb: Optional[float] = typer.Option(None, help="host RAM per node, GB"),
    hbm_gb: Optional[float] = typer.Option(None, help="HBM per card, GB"),
    pcie_gbps: Optional[float] = typer.Option(None, help="pinned PCIe GB/s per direction"),
    nvlink_gbps: Optional[float] = typer.Option(None, help="NVLink GB/s per direction"),
    decode_tbps: Optional[float] = typer.Option(None, help="effective decode HBM TB/s"),
    activation_gb: Optional[float] = typer.Option(None, help="engine activation peak, GB"),
    graph_pool_gb: Optional[float] = typer.Option(None, help="CUDA graph pool, GB"),
    resident_gb: Optional[float] = typer.Option(None, help="contexts, NCCL, allocator residue GB"),
    train_activation_gb: Optional[float] = typer.Option(None, help="trainer activations/card, GB"),
    train_tflops: Optional[float] = typer.Option(None, help="trainer model TFLOP/s per card "
                                                 "(handoff bench train-compute)"),
    config: Optional[str] = typer.Option(None, help="YAML config file"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    markdown: bool = typer.Option(False, help="print Markdown tables"),
    plot: Optional[str] = typer.Option(None, help="also draw the utilization sweep to this PNG"),
) -> None:
    """What moves at each switch, the KV-pool tax, and whether to colocate at all.

    A run that does not fit gets the whole plan too, with the verdict "does not fit", every
    reason and a change that re-plans to a fit; the exit status is then 3."""
    import json

    from handoff import compile_cache
    from handoff.model_source import resolve_model
    from handoff.plan.lora_report import build_lora_plan
    from handoff.plan.render import render_markdown, render_rich
    from handoff.plan.report import build_plan, plan_config
    from handoff.plan.shapes import load_shape

    flags = dict(locals())
    if plot and not plot.lower().endswith(".png"):
        raise HandoffError(f"--plot {plot!r} is not a .png path: the sweep is drawn as a PNG, "
                           "e.g. --plot plan.png")
    cfg, auto_tp = plan_config(config, overrides, flags)
    # A Hub id is read from the local cache; a preset stays a shape (no weights written).
    cfg.model.path = resolve_model(cfg.model.path, materialise_presets=False)
    # actor.compile=auto priced warm when the compile cache holds this layer shape
    warm = compile_cache.is_warm(compile_cache.layer_key(load_shape(cfg.model.path),
                                                         cfg.model.dtype))
    build = build_lora_plan if cfg.actor.lora.rank else build_plan
    report = build(cfg, grad_offload=grad_offload, auto_tp_size=auto_tp, compile_warm=warm)
    wl, ro = cfg.workload, cfg.rollout
    if config and wl.response_len > ro.max_tokens:   # the planner's default workload, not the run's
        err_console.print(
            f"[yellow]warning: the plan is of responses of {wl.response_len} tokens (workload."
            f"response_len), longer than this config's rollout.max_tokens={ro.max_tokens}: set "
            "workload.prompt_len and workload.response_len in the config, or pass --prompt-len "
            "and --response-len, to plan this run's own step[/]", highlight=False, soft_wrap=True)
    if plot:   # drawn first: a --plot that cannot be written is the only line
        from handoff.plan.plot import plot_utilization
        from handoff.safe_files import cannot_write

        try:
            err_console.print(f"wrote {plot_utilization(report, plot)}", markup=False)
        except OSError as e:   # read-only, full, or a file where its directory goes
            raise cannot_write(f"--plot {plot!r}", e, "pass a .png path in a directory you "
                               "can write to") from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    elif markdown:
        typer.echo(render_markdown(report), nl=False)
    else:
        render_rich(report, console)
    if not report["verdict"]["fits"]:
        sys.exit(PLAN_DOES_NOT_FIT)
