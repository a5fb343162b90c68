"""`handoff init-model` (write a checkpoint) and `handoff generate` (sample from one)."""

from __future__ import annotations

import typer

from handoff.cli import app, console, friendly_errors


@app.command("init-model")
@friendly_errors
def init_model_cmd(
    preset: str = typer.Option(..., "--preset", help="shape preset, e.g. tiny-qwen3, qwen3-4b, "
                               "or smollm2-135m-instruct (the real pretrained demo model)"),
    out: str = typer.Option(..., "--out", help="directory to write the checkpoint to"),
    seed: int = typer.Option(0, help="random-init seed"),
    dtype: str = typer.Option(None, help="bfloat16 | float32 (default: bfloat16; float32 for "
                              "smollm2-135m-instruct)"),
    device: str = typer.Option("cpu", help="where to initialise (cuda is faster for big shapes)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="write into a directory that "
                                   "already holds files (refused without it)"),
) -> None:
    """Write an HF checkpoint (config.json, model.safetensors, tokenizer): random-init of a
    preset shape, or the real SmolLM2-135M-Instruct converted from its GGUF."""
    from handoff.modelzoo import init_model

    path = init_model(preset, out, seed=seed, dtype=dtype, device=device, overwrite=overwrite)
    console.print(f"wrote {preset} checkpoint to {path}")


@app.command("generate")
@friendly_errors
def generate_cmd(
    model: str = typer.Option(..., "--model", help="HF checkpoint directory"),
    prompt: list[str] = typer.Option(..., "--prompt", help="prompt text (repeat for several)"),
    max_tokens: int = typer.Option(64, "--max-tokens", help="most new tokens per sample"),
    temperature: float = typer.Option(1.0, "--temperature", help="0: greedy"),
    n: int = typer.Option(1, "--n", "-n", help="samples per prompt (-n under torchrun, whose "
                          "own --nnodes makes --n ambiguous)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus mass (1: off)"),
    seed: int = typer.Option(-1, "--seed", help="sampling seed (-1: random)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    tp: int = typer.Option(1, "--tp", help="tensor parallel ranks (launch that many processes "
                           "with torchrun --nproc-per-node)"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list, one entry per sample"),
) -> None:
    """Generate completions with the built-in rollout engine."""
    import json

    from handoff.rollout.cli_generate import generate_samples, is_main_process
    from handoff.dist import end_distributed_run

    samples = generate_samples(model, prompt, max_tokens=max_tokens, temperature=temperature,
                               n=n, top_p=top_p, seed=None if seed < 0 else seed,
                               device=None if device == "auto" else device, tp=tp)
    if is_main_process() and as_json:
        typer.echo(json.dumps(samples))
    elif is_main_process():
        for s in samples:
            console.print(f"[bold]{s['prompt']!r}[/] -> {s['text']!r} "
                          f"({len(s['token_ids'])} tokens, {s['finish_reason']})", highlight=False)
    if tp > 1:   # not after an error: another rank may still sit in a collective
        end_distributed_run()
