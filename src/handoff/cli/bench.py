"""`handoff bench ...`: the benchmarks on the machine at hand, each a table on the console and
its full result as JSON."""

from __future__ import annotations

import functools
from typing import Callable, Optional

import typer

from handoff.cli import app, console, float_list, friendly_errors, int_list, positive
from handoff.errors import HandoffError

bench_app = typer.Typer(no_args_is_help=True,
                        help="Benchmarks on the machine at hand (results go in docs/PERF.md).")
app.add_typer(bench_app, name="bench")


@bench_app.command("memory")
@friendly_errors
def bench_memory_cmd(
    out: str = typer.Option("bench-memory.json", "--out", help="where to write the JSON result"),
    size_gib: float = typer.Option(4.0, help="bytes per staged set and per level-1 region"),
    kv_gib: float = typer.Option(30.0, help="size of the kv_cache region slept and woken"),
    repeats: int = typer.Option(5, help="repetitions per measurement (best or median)"),
    device: str = typer.Option("auto", help="auto | cuda | cpu"),
) -> None:
    """Pinned copy floor, arena offload/onload, full duplex, region sleep/wake, level 1."""
    from handoff.bench.memory import render, run_memory_bench

    positive(size_gib=size_gib, kv_gib=kv_gib, repeats=repeats)
    try:
        result = run_memory_bench(size_gib=size_gib, kv_gib=kv_gib, repeats=repeats,
                                  device=device)
    except (RuntimeError, MemoryError) as e:   # torch.OutOfMemoryError is a RuntimeError
        if "memory" not in str(e).lower():
            raise
        raise HandoffError(f"bench memory: cannot allocate --size-gib {size_gib:g} / --kv-gib "
                           f"{kv_gib:g} on this device ({str(e).splitlines()[0][:80]}): pass "
                           "smaller sizes") from None
    _show_and_save(result, out, render)


def _save(result: dict, out: str) -> None:
    import json

    with open(out, "w") as f:
        json.dump(result, f, indent=2)


def _show_and_save(result: dict, out: str, render: Callable) -> None:
    """A bench's table on the console and its full result as JSON at `out`."""
    render(result, console)
    _save(result, out)
    console.print(f"wrote {out}", markup=False)


def _saved_part(out: str) -> Callable[[str, dict], None]:
    """After each part of a long bench: its result so far at `out`, and a line saying so."""
    def saved(name: str, result: dict) -> None:
        _save(result, out)
        console.print(f"{name}: measured (so far in {out})", markup=False)
    return saved


@bench_app.command("kernel")
@friendly_errors
def bench_kernel_cmd(
    out: str = typer.Option("bench-kernel.json", "--out", help="where to write the JSON result"),
    batches: str = typer.Option("1,8,64,256", help="batch sizes, comma-separated"),
    contexts: str = typer.Option("512,2048,8192", help="context lengths, comma-separated"),
    block_sizes: str = typer.Option("16,64", help="KV block sizes, comma-separated"),
    variants: str = typer.Option("", help="extra configs T:W:S[:waves], e.g. 64:4:5,128:4:3"),
    kv_dtype: str = typer.Option("bfloat16", help="bfloat16 | fp8 (e4m3 with scales)"),
    timer: str = typer.Option("graph", help="graph (CUDA-graph replays) | events (eager)"),
    prefill: bool = typer.Option(False, help="also time paged prefill (gather + varlen_attn)"),
    kv_memory: str = typer.Option("torch", help="torch | elastic (the KV pools in an elastic "
                                  "VMM region, as rollout.kv_pool=elastic)"),
) -> None:
    """Paged decode kernel alone vs SDPA on contiguous KV, in bytes/s (CUDA only)."""
    from handoff.bench.kernel import parse_variants, render, run_kernel_bench

    result = run_kernel_bench(
        batches=int_list(batches, "--batches"), contexts=int_list(contexts, "--contexts"),
        block_sizes=int_list(block_sizes, "--block-sizes"), variants=parse_variants(variants),
        kv_dtype=kv_dtype, timer=timer, prefill=prefill, kv_memory=kv_memory)
    _show_and_save(result, out, render)


@bench_app.command("engine")
@friendly_errors
def bench_engine_cmd(
    out: str = typer.Option("bench-engine.json", "--out", help="where to write the JSON result"),
    models: str = typer.Option("qwen3-1.7b,qwen3-4b", help="model presets, comma-separated"),
    batches: str = typer.Option("1,32,128,256", help="decode batch sizes, comma-separated"),
    prompt_len: int = typer.Option(256, help="prompt tokens per sequence"),
    new_tokens: int = typer.Option(512, help="new tokens per sequence (EOS ignored)"),
    hf_new_tokens: int = typer.Option(32, help="new tokens transformers is timed over"),
    skip_hf: bool = typer.Option(False, "--skip-hf", help="skip the transformers baseline"),
    public: bool = typer.Option(True, "--public/--no-public",
                                help="also run the 0.6B / 256-sequence public workload"),
    public_seqs: int = typer.Option(256, help="sequences in the public workload"),
    public_model: str = typer.Option("qwen3-0.6b", help="model preset of the public workload"),
    public_lengths: str = typer.Option("100,1024", help="public workload: min,max prompt and "
                                       "output length"),
    util: float = typer.Option(0.5, help="engine gpu_memory_utilization"),
    device: str = typer.Option("cuda", help="cuda | cpu (cpu: a smoke run with tiny models)"),
    dtype: str = typer.Option("bfloat16", help="model dtype"),
    lora_rank: int = typer.Option(0, "--lora-rank", help="also decode with a random adapter "
                                  "of this rank on all seven projections, beside the base "
                                  "(0: off)"),
    graph_sampling: bool = typer.Option(True, "--graph-sampling/--no-graph-sampling",
                                        help="the LM head and the sampler inside the decode "
                                        "graphs (rollout.graph_sampling)"),
    decode_gemm: str = typer.Option("cublas", "--decode-gemm", help="rollout.decode_gemm: "
                                    "cublas | cublaslt | triton (<= 32 rows) | auto (times each at "
                                    "each batch size)"),
) -> None:
    """Engine decode step vs transformers generate and the HBM floor; the public workload;
    with --lora-rank, the decode step with an adapter beside the one without."""
    from handoff.bench.engine import render, run_engine_bench

    positive(prompt_len=prompt_len, new_tokens=new_tokens, hf_new_tokens=hf_new_tokens,
              public_seqs=public_seqs, util=util)
    result = run_engine_bench(
        models=[m.strip() for m in models.split(",") if m.strip()],
        batches=int_list(batches, "--batches"), prompt_len=prompt_len, new_tokens=new_tokens,
        hf_new_tokens=hf_new_tokens, skip_hf=skip_hf, public=public, public_seqs=public_seqs,
        public_model=public_model,
        public_lengths=tuple(int_list(public_lengths, "--public-lengths")),
        util=util, device=device, dtype=dtype, lora_rank=lora_rank,
        graph_sampling=graph_sampling, decode_gemm=decode_gemm, on_part=_saved_part(out))
    _show_and_save(result, out, render)


@bench_app.command("sweep", context_settings={"allow_extra_args": False})
@friendly_errors
def bench_sweep_cmd(
    config: str = typer.Argument(..., help="YAML config of the run to sweep"),
    overrides: Optional[list[str]] = typer.Argument(None, help="overrides key.sub=value"),
    out: str = typer.Option("sweep", "--out", help="directory of sweep.json / .md / .png "
                            "and the points' runs (running again adds points)"),
    utils: Optional[str] = typer.Option(None, help="gpu_memory_utilization points, e.g. "
                                        "0.5,0.6 (default: 0.50 up by 0.05 to the boundary; "
                                        "with --offloads: each set's highest safe one)"),
    offloads: Optional[str] = typer.Option(None, help="offload sets to sweep: none, ref, "
                                           "params+ref, all (default: the config's)"),
    steps: int = typer.Option(3, help="steps per point (the first is a warm-up)"),
    exclusive: bool = typer.Option(True, "--exclusive/--no-exclusive",
                                   help="also run the engine alone on the card"),
    timeout: float = typer.Option(600.0, help="seconds a point may run"),
    replan: bool = typer.Option(False, "--replan", help="run nothing: plan the points of "
                                "--out again (from the rates each measured) and rewrite its files"),
) -> None:
    """gpu_memory_utilization from 0.5 to the out-of-memory boundary, the real colocated loop
    at each point, the planner's curve beside it: the source's closing practice."""
    from pathlib import Path

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from handoff.bench.sweep import (check_sweep_args, check_sweep_model, check_sweep_out,
                                     replan as replan_sweep, run_sweep)
    from handoff.config import load_config

    if replan:
        state = replan_sweep(config, list(overrides or []), out)
        console.print((Path(out) / "sweep.md").read_text(), highlight=False, markup=False)
        console.print(f"planned {len(state['points'])} points again: {out}/sweep.md, sweep.png",
                      markup=False)
        return

    util_list = float_list(utils, "--utils") if utils else None
    offload_list = [o.strip() for o in offloads.split(",")] if offloads else None
    check_sweep_args(utils=util_list, offloads=offload_list, steps=steps)   # before the bar
    check_sweep_model(load_config(config, list(overrides or [])))
    check_sweep_out(Path(out))
    with Progress(SpinnerColumn(), TextColumn("[bold]sweep"), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console) as bar:
        task = bar.add_task("", total=None)
        state = run_sweep(config, list(overrides or []), out_dir=out, utils=util_list,
                          offloads=offload_list, steps=steps, exclusive=exclusive,
                          timeout_s=timeout,
                          progress=lambda text: bar.update(task, description=text))
    console.print((Path(out) / "sweep.md").read_text(), highlight=False, markup=False)
    console.print(f"wrote {out}/sweep.json, sweep.md, sweep.png ({len(state['points'])} points)",
                  markup=False)


@bench_app.command("trainer")
@friendly_errors
def bench_trainer_cmd(
    model: str = typer.Option(..., "--model", help="HF checkpoint dir, a preset or a cached "
                              "Hub id (handoff init-model)"),
    out: str = typer.Option("bench-trainer.json", "--out", help="where to write the JSON result"),
    device: str = typer.Option("cuda", help="cuda | cpu"),
    dtype: str = typer.Option("bfloat16", help="param dtype of actor and reference"),
    repeats: int = typer.Option(3, help="offload/onload rounds (median reported)"),
    rows: int = typer.Option(8, help="sequences in the warm-up GRPO batch (a multiple of 4, "
                             "its group)"),
    seq_len: int = typer.Option(512, help="tokens per sequence in that batch"),
    hardware: str = typer.Option("h200", help="hardware profile the ledger is computed for"),
    compare_fsdp: bool = typer.Option(False, help="also time an update with FSDP2 CPUOffloadPolicy"),
) -> None:
    """Actor/ref offload and onload per part, measured vs the ledger of `handoff plan`."""
    from handoff.bench.trainer import render, run_trainer_bench
    from handoff.model_source import resolve_model

    positive(repeats=repeats, rows=rows, seq_len=seq_len)
    result = run_trainer_bench(resolve_model(model, flag="--model"), device=device, dtype=dtype,
                               repeats=repeats, rows=rows, seq_len=seq_len, hardware=hardware,
                               compare_fsdp=compare_fsdp)
    _show_and_save(result, out, render)


@bench_app.command("train-compute")
@friendly_errors
def bench_train_compute_cmd(
    model: str = typer.Option(..., "--model", help="HF checkpoint dir, a preset or a cached "
                              "Hub id (handoff init-model)"),
    out: str = typer.Option("bench-train-compute.json", "--out", help="where to write the JSON"),
    device: str = typer.Option("cuda", help="cuda | cpu (cpu: a smoke run with a tiny model)"),
    dtype: str = typer.Option("bfloat16", help="param dtype of actor and reference"),
    rows: int = typer.Option(256, help="sequences in the rollout batch"),
    prompt_len: int = typer.Option(36, help="prompt tokens per sequence"),
    response_lens: str = typer.Option("256", help="response tokens: N | N,M,... (cycled) | "
                                      "uniform:LO:HI | longtail:MEDIAN:MAX"),
    group: int = typer.Option(8, help="samples per prompt (the GRPO group)"),
    variant: Optional[list[str]] = typer.Option(
        None, "--variant", help="padded | packed | compiled | NAME:key=value,... "
        "(micro_batch_tokens, micro_batch_size, logprob_chunk_tokens, gradient_checkpointing, "
        "compile); repeat to compare in one run (default: padded, packed)"),
    micro_batch_size: int = typer.Option(16, help="rows per micro-batch of the padded variant"),
    gradient_checkpointing: bool = typer.Option(
        True, "--gradient-checkpointing/--no-gradient-checkpointing",
        help="recompute in the padded variant (as examples/h200-4b.yaml did)"),
    repeats: int = typer.Option(2, help="timed rounds per variant after a warm-up (median)"),
    offload: bool = typer.Option(True, "--offload/--no-offload", help="ref params and optimizer "
                                 "on the card only for their part, as in the colocated step"),
    profile: bool = typer.Option(True, "--profile/--no-profile", help="one profiled round per "
                                 "variant: time per category, launches"),
    matmul_size: Optional[int] = typer.Option(None, help="n of the n^3 matmul peak (default "
                                              "8192 on CUDA, 256 on CPU)"),
    hardware: Optional[str] = typer.Option(None, help="profile that sizes 'auto' micro-batches "
                                           "(default h200 on CUDA, cpu on CPU)"),
) -> None:
    """The step's trainer work per part (ref forward, actor forward + backward, optimizer):
    seconds, tokens/s, model TFLOP/s, MFU against a matmul timed in the same run, peak
    memory and a profile summary, for several micro-batching variants in one run."""
    from handoff.bench.train_compute import render, run_train_compute_bench
    from handoff.model_source import resolve_model

    result = run_train_compute_bench(
        resolve_model(model, flag="--model"), device=device, dtype=dtype, rows=rows,
        prompt_len=prompt_len,
        response_lens=response_lens, group=group, variants=variant,
        micro_batch_size=micro_batch_size, gradient_checkpointing=gradient_checkpointing,
        repeats=repeats, offload=offload, profile=profile, matmul_size=matmul_size,
        hardware=hardware, on_variant=functools.partial(_variant_done, out))
    _show_and_save(result, out, render)


def _variant_done(out: str, result: dict, variant: dict) -> None:
    """One line per finished variant, and the JSON so far at `out` (a run cut short keeps it)."""
    import json

    if variant["oom"]:
        line = f"{variant['name']}: out of memory ({variant['error']})"
    else:
        line = (f"{variant['name']}: {variant['compute_seconds']:.2f} s, "
                f"{variant['model_tflops']:.0f} TFLOP/s, MFU {variant['mfu']:.1%}")
    console.print(line, highlight=False, markup=False)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)

