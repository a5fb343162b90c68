"""`handoff init-model` (write a checkpoint), `handoff generate` (sample from one) and
`handoff export` (a run's checkpoint out as one)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

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
    from handoff.safe_files import cannot_write

    try:
        path = init_model(preset, out, seed=seed, dtype=dtype, device=device,
                          overwrite=overwrite)
    except OSError as e:   # read-only, a full disk: what it made is removed by then
        raise cannot_write(f"--out {out!r}", e, "pass a directory you can write to") from None
    console.print(f"wrote {preset} checkpoint to {path}", markup=False)


@app.command("generate")
@friendly_errors
def generate_cmd(
    model: str = typer.Option(..., "--model", help="HF checkpoint directory, a preset or a "
                              "Hub id org/name in the local Hugging Face cache"),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt",
                                               help="prompt text (repeat for several)"),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", help="a text file, one "
                                              "prompt a line (after any --prompt)"),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="send each prompt through the "
                              "tokenizer's chat template when it has one (--no-chat: raw text)"),
    max_tokens: int = typer.Option(64, "--max-tokens", help="most new tokens per sample"),
    temperature: float = typer.Option(1.0, "--temperature", help="0: greedy"),
    n: int = typer.Option(1, "--n", "-n", help="samples per prompt (-n under torchrun, whose "
                          "own --nnodes makes --n ambiguous)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus mass (1: off)"),
    seed: int = typer.Option(-1, "--seed", help="sampling seed: the same command gives the "
                             "same samples, each prompt its own stream (-1: random)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    tp: int = typer.Option(1, "--tp", help="tensor parallel ranks (launch that many processes "
                           "with torchrun --nproc-per-node)"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list, one entry per sample"),
) -> None:
    """Generate completions with the built-in rollout engine."""
    import json

    from handoff.dist import end_distributed_run
    from handoff.model_source import resolve_model
    from handoff.rollout.cli_generate import generate_samples, is_main_process, read_prompt_file

    prompts = list(prompt or []) + (read_prompt_file(prompt_file) if prompt_file else [])
    samples = generate_samples(resolve_model(model, flag="--model"), prompts,
                               max_tokens=max_tokens, temperature=temperature, n=n, top_p=top_p,
                               seed=None if seed < 0 else seed,
                               device=None if device == "auto" else device, tp=tp, chat=chat)
    if is_main_process() and as_json:
        typer.echo(json.dumps(samples))
    elif is_main_process():
        for s in samples:
            console.print(f"[bold]{escape(repr(s['prompt']))}[/] -> {escape(repr(s['text']))} "
                          f"({len(s['token_ids'])} tokens, {s['finish_reason']})", highlight=False)
    if tp > 1:   # not after an error: another rank may still sit in a collective
        end_distributed_run()


@app.command("export")
@friendly_errors
def export_cmd(
    run_dir: str = typer.Argument(..., help="run.out_dir of a `handoff train` run"),
    out: str = typer.Option(..., "--out", help="directory to write the Hugging Face model to"),
    step: Optional[int] = typer.Option(None, "--step", help="the checkpoint of this step "
                                       "(default: the latest complete one)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="write into a directory that "
                                   "already holds files (an earlier export's are all replaced; "
                                   "others are kept)"),
    adapter: bool = typer.Option(False, "--adapter", help="a LoRA run: its PEFT adapter "
                                 "directory (default: the adapter merged into the model)"),
    model: Optional[str] = typer.Option(None, "--model", help="the model directory the run "
                                        "trained, instead of its config.json's model.path "
                                        "(an older run's relative path)"),
) -> None:
    """A run's checkpoint as a Hugging Face model directory (safetensors in the trained dtype,
    config, generation config, tokenizer): transformers' from_pretrained and `handoff
    generate --model DIR` load it. A LoRA run's adapter is merged in, or with --adapter
    written as a PEFT adapter directory (PeftModel.from_pretrained loads it)."""
    import json

    from handoff.export import export_model

    path = export_model(run_dir, out, step=step, overwrite=overwrite, adapter=adapter,
                        model=model)
    done = json.loads((path / "handoff_export.json").read_text())
    what = (" (its LoRA adapter, for peft)" if adapter else
            " (its LoRA adapter merged into the model)" if done["lora"] else "")
    console.print(f"exported step {done['step']} of {run_dir} ({done['checkpoint']}) to {path}"
                  f"{what}", highlight=False)
