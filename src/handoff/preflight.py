"""Checks `handoff train` makes before any work: is the launch whole, is the model there and
of one piece with its tokenizer, does every data record fit, does the plan fit.

A run that cannot fit should fail in a second with the planner's reasons, not after minutes
of loading with an out-of-memory error on the first wake; nor should a run train for an
hour and then die writing a checkpoint its disk cannot hold, or at step 40 on the one data
record too long for rollout.max_model_len.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rich.console import Console

from handoff.config import Config
from handoff.dist import launch_env
from handoff.errors import HandoffError
from handoff.loggers import check_loggers
from handoff.model_files import cap_context, check_model_dir, load_tokenizer
from handoff.plan.lora import adapter_params, adapter_tensors
from handoff.run_dir import check_out_dir
from handoff.runplan import RunPlan
from handoff.tasks import DatasetTask, build_eval_problems, build_task


def preflight(cfg: Config) -> RunPlan:
    """Raise HandoffError naming cause and fix when `cfg` cannot run; returns the run's plan
    (built once here, after the model's files are checked).

    May lower rollout.max_model_len to the model's context length, and turn
    memory.param_offload off under LoRA on a shared base (each with a warning)."""
    launch_env()   # torchrun's variables whole and in range, or one line
    check_model_dir(cfg.model.path, flag="model.path")
    cap_context(cfg)
    lora_settings(cfg)
    check_prompt_lengths(cfg)
    check_out_dir(cfg)
    check_loggers(cfg.run.loggers)
    run_plan = RunPlan.build(cfg)
    if cfg.data.prompts_per_step % cfg.parallel.gpus:
        raise HandoffError(f"data.prompts_per_step={cfg.data.prompts_per_step} does not split "
                           f"over parallel.gpus={cfg.parallel.gpus} ranks: use a multiple of it")
    if cfg.run.resume:
        _check_resume(cfg)
    if cfg.run.checkpoint:
        _check_checkpoint_room(cfg, run_plan)
    if cfg.hardware.name == "cpu":
        return run_plan
    from handoff.plan.advice import advice_text
    from handoff.plan.lora_report import build_lora_plan
    from handoff.plan.report import build_plan

    plan = build_lora_plan(cfg) if cfg.actor.lora.rank else build_plan(cfg)
    verdict = plan["verdict"]
    if not verdict["fits"]:
        reasons = "; ".join(r for r in verdict["reasons"] if r.startswith("does not fit"))
        raise HandoffError(f"the planner says this run cannot fit: {reasons}; "
                           f"{advice_text(verdict['advice'])}. Run `handoff plan --config "
                           "CONFIG` for the full ledger")
    return run_plan


def lora_settings(cfg: Config) -> None:
    """LoRA on a shared base needs a whole engine per card (TP 1), and memory.param_offload
    has nothing to move then (the base is the engine's weights, the adapters stay on the
    card): turned off, with a warning; memory.offload_mode=fsdp has no FSDP to act in (the
    shared base is not wrapped): the adapters' state moves through the arena, with a
    warning. (`handoff plan` prices a TP engine and says why not.)"""
    lora = cfg.actor.lora
    if lora.rank:
        from handoff.plan.lora_report import check_rank
        from handoff.plan.shapes import load_shape

        check_rank(lora.rank, load_shape(cfg.model.path).hidden_size)
    tp = cfg.parallel.tp
    if lora.shares_base and tp > 1:
        raise HandoffError(f"actor.lora.share_base with parallel.tp={tp}: the trainer's base can "
                           "only be a view of an engine that holds the whole model; set "
                           "actor.lora.share_base=false (the trainer keeps its own sharded base)")
    if not lora.shares_base:
        return
    warnings = []
    if cfg.memory.param_offload:
        warnings.append("memory.param_offload is off under actor.lora.share_base: the base is "
                        "the engine's weights and never moves, the adapters stay on the card")
        cfg.memory.param_offload = False
    if cfg.memory.offload_mode == "fsdp":
        warnings.append("memory.offload_mode is arena under actor.lora.share_base: the shared "
                        "base is not FSDP-wrapped, so FSDP's CPU offload would move nothing; the "
                        "adapters' optimizer state moves through the pinned arena")
        cfg.memory.offload_mode = "arena"
    if warnings and os.environ.get("RANK", "0") == "0":
        for text in warnings:
            Console(stderr=True).print(f"[yellow]warning: {text}[/]", highlight=False)


def check_prompt_lengths(cfg: Config) -> None:
    """Every record of a data file, and of the evaluation set's (its first eval.n, when the run
    evaluates), leaves rollout.max_tokens of rollout.max_model_len free (the engine would
    refuse the first batch holding a longer one, mid-run: an evaluation's after a step); and
    the chat template renders the first prompt of any task."""
    task = build_task(cfg.data, seed=cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    # A template that does not parse, or raises, is one line here, before the run writes
    # anything, not a traceback at step 1 (a generated task's prompts are checked nowhere else).
    task.render_prompt(task.get(0), tokenizer, chat=cfg.data.chat_template)
    checked = [(task, None)]
    evaluation = (build_eval_problems(cfg.data, cfg.eval, seed=cfg.run.seed)
                  if cfg.run.eval_every else None)   # the loop's own condition
    if evaluation is not None:
        checked.append((evaluation[0], len(evaluation[1])))
    # generated problems are not checked here: the engine checks each
    checked = [(task, rows) for task, rows in checked if isinstance(task, DatasetTask)]
    if not checked:
        return
    ro = cfg.rollout
    for task, rows in checked:
        task.check_prompt_lengths(tokenizer, limit=ro.max_model_len - ro.max_tokens,
                                  chat=cfg.data.chat_template, rows=rows,
                                  setting=f"rollout.max_model_len={ro.max_model_len} minus "
                                          f"rollout.max_tokens={ro.max_tokens}")


def _check_resume(cfg: Config) -> None:
    """A resume whose checkpoint is past run.steps, or at it with the summary written (a
    finished run), fails now, not after loading; at it without one the resume writes it."""
    ckpt_dir = Path(cfg.run.out_dir) / "checkpoints"
    step = _start_step(Path(cfg.run.out_dir))
    finished = (Path(cfg.run.out_dir) / "summary.json").is_file()
    if step > cfg.run.steps or step == cfg.run.steps and finished:
        raise HandoffError(f"the checkpoint in {ckpt_dir} is at step {step}, "
                           f"run.steps={cfg.run.steps}: raise run.steps to train further")


def _start_step(out_dir: Path) -> int:
    """The step --resume continues from (0 when there is no checkpoint), its meta.json
    checked (a hand edit is one line before the card is touched)."""
    from handoff.run_dir import resume_point
    from handoff.tasks.base import checkpoint_task_state
    from handoff.trainer.checkpoint import checkpoint_meta

    path, _ = resume_point(out_dir)
    if path is None:
        return 0
    meta = checkpoint_meta(path)
    checkpoint_task_state(meta, f"{path / 'meta.json'}")
    return meta["step"]


def count_saves(start: int, steps: int, every: int) -> int:
    """Checkpoints a run from step `start` to `steps` writes: each `every` steps (0: none)
    and one at the end; counted, not walked (run.steps may be 10**7)."""
    if steps <= start:
        return 0
    periodic = steps // every - start // every if every else 0
    return periodic + (0 if every and steps % every == 0 else 1)


def checkpoint_bytes(plan: RunPlan) -> int:
    """Bytes of one checkpoint: the params in model.dtype plus, as the trainer keeps them,
    the fp32 master copy (none for fp32 params) and Adam's two fp32 moments; one file per
    tensor, each with its overhead; every rank's RNG states.

    Per parameter: bfloat16 params 2 B + fp32 master 4 B + Adam's moments 8 B = 14 B, so
    14 GB per billion parameters; float32 params (no master) 4 + 8 = 12 GB per billion (the
    135M CPU demo: 1.6 GB a checkpoint, 3.2 GB for the two kept). The files' overhead is
    ~2 KB per tensor, nothing at scale (a tiny-qwen3 run's checkpoint measured 14.0 / 12.0 B
    of tensors per param, its DCP metadata read back). Under LoRA: the adapters only."""
    from handoff.trainer.checkpoint_files import FILE_OVERHEAD_BYTES, RNG_FILE_BYTES

    shape, lora = plan.shape, plan.cfg.actor.lora
    params, tensors = shape.num_params, shape.num_tensors
    if lora.rank:   # a LoRA checkpoint holds the adapters and their optimizer state only
        params = adapter_params(shape, lora.rank, lora.target_modules)
        tensors = adapter_tensors(shape, lora.target_modules)
    files = tensors * (1 + (1 if plan.dtypes.master_bytes else 0) + 2)
    return (params * plan.checkpoint_param_bytes()
            + files * FILE_OVERHEAD_BYTES + plan.cfg.parallel.gpus * RNG_FILE_BYTES)


def _check_checkpoint_room(cfg: Config, plan: RunPlan) -> None:
    """Refuse a run whose checkpoints cannot fit on out_dir's filesystem.

    A save writes a new checkpoint next to those kept (run.keep_checkpoints after each
    publish), so the disk holds at most that many + 1 at once; the checkpoints already there
    are on the disk (not free) and leave as new ones replace them.
    """
    run = cfg.run
    keep = run.keep_checkpoints
    ckpt_dir = Path(run.out_dir) / "checkpoints"
    start = _start_step(Path(run.out_dir)) if run.resume else 0
    saves = count_saves(start, run.steps, run.save_every)
    if saves == 0:
        return
    kept = sum(1 for p in ckpt_dir.glob("step_*") if (p / "meta.json").is_file())
    # During save i the disk holds what the last publish kept plus the one being written.
    peak = max(kept + 1, min(kept + saves - 1, keep) + 1)
    one = checkpoint_bytes(plan)
    need = (peak - kept) * one
    where = ckpt_dir
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise HandoffError(
            f"checkpoints need {_size(need)} on the filesystem of run.out_dir={run.out_dir!r} "
            f"({peak - kept} new of {_size(one)}: params + fp32 master + Adam moments, the last "
            f"{keep} kept) but only {_size(free)} are free: set run.checkpoint=false or "
            "point run.out_dir at a filesystem with room")


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
