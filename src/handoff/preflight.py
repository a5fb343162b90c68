"""Checks `handoff train` makes before any work: is the model there, does the plan fit.

A run that cannot fit should fail in a second with the planner's reasons, not after minutes
of loading with an out-of-memory error on the first wake; nor should a run train for an
hour and then die writing a checkpoint its disk cannot hold.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from handoff.config import Config
from handoff.errors import HandoffError
from handoff.model_files import cap_context, check_model_dir
from handoff.run_dir import check_out_dir


def preflight(cfg: Config) -> dict | None:
    """Raise HandoffError naming cause and fix when `cfg` cannot run; returns the plan on GPUs.

    May lower rollout.max_model_len to the model's context length (with a warning)."""
    check_model_dir(cfg.model.path, flag="model.path")
    cap_context(cfg)
    check_out_dir(cfg)
    if cfg.data.prompts_per_step % cfg.parallel.gpus:
        raise HandoffError(f"data.prompts_per_step={cfg.data.prompts_per_step} does not split "
                           f"over parallel.gpus={cfg.parallel.gpus} ranks: use a multiple of it")
    if cfg.run.resume:
        _check_resume(cfg)
    if cfg.run.checkpoint:
        _check_checkpoint_room(cfg)
    if cfg.hardware.name == "cpu":
        return None
    from handoff.plan.advice import advice_text
    from handoff.plan.report import build_plan

    plan = build_plan(cfg, ref=cfg.actor.kl_coef > 0)
    verdict = plan["verdict"]
    if not verdict["fits"]:
        reasons = "; ".join(r for r in verdict["reasons"] if r.startswith("does not fit"))
        raise HandoffError(f"the planner says this run cannot fit: {reasons}; "
                           f"{advice_text(verdict['advice'])}. Run `handoff plan --config "
                           "CONFIG` for the full ledger")
    return plan


def _check_resume(cfg: Config) -> None:
    """A resume whose checkpoint is past run.steps, or at it with the summary written (a
    finished run), fails now, not after loading; at it without one the resume writes it."""
    ckpt_dir = Path(cfg.run.out_dir) / "checkpoints"
    step = _start_step(ckpt_dir)
    finished = (Path(cfg.run.out_dir) / "summary.json").is_file()
    if step > cfg.run.steps or step == cfg.run.steps and finished:
        raise HandoffError(f"the checkpoint in {ckpt_dir} is at step {step}, "
                           f"run.steps={cfg.run.steps}: raise run.steps to train further")


def _start_step(ckpt_dir: Path) -> int:
    """The step of the latest complete checkpoint (0 when there is none)."""
    from handoff.train.checkpoint import checkpoint_step, latest_checkpoint

    latest = latest_checkpoint(ckpt_dir)
    return checkpoint_step(latest) if latest else 0


def checkpoint_bytes(cfg: Config) -> int:
    """Bytes of one checkpoint: the params in model.dtype plus, as the trainer keeps them,
    the fp32 master copy (none for fp32 params) and Adam's two fp32 moments; one file per
    tensor, each with its overhead; every rank's RNG states."""
    from handoff.plan.ledger import Dtypes
    from handoff.plan.shapes import load_shape
    from handoff.train.checkpoint_files import FILE_OVERHEAD_BYTES, RNG_FILE_BYTES

    d = Dtypes.for_model(cfg.model.dtype)
    shape = load_shape(cfg.model.path)
    files = shape.num_tensors * (1 + (1 if d.master_bytes else 0) + 2)
    return (shape.num_params * (d.param_bytes + d.master_bytes + d.optimizer_bytes)
            + files * FILE_OVERHEAD_BYTES + cfg.parallel.gpus * RNG_FILE_BYTES)


def _check_checkpoint_room(cfg: Config) -> None:
    """Refuse a run whose checkpoints cannot fit on out_dir's filesystem.

    A save writes a new checkpoint next to those kept (run.keep_checkpoints after each
    publish), so the disk holds at most that many + 1 at once; the checkpoints already there
    are on the disk (not free) and leave as new ones replace them.
    """
    run = cfg.run
    keep = run.keep_checkpoints
    ckpt_dir = Path(run.out_dir) / "checkpoints"
    start = _start_step(ckpt_dir) if run.resume else 0
    saves = sum(1 for done in range(start + 1, run.steps + 1)
                if done == run.steps or (run.save_every and done % run.save_every == 0))
    if saves == 0:
        return
    kept = sum(1 for p in ckpt_dir.glob("step_*") if (p / "meta.json").is_file())
    # During save i the disk holds what the last publish kept plus the one being written.
    peak = max(kept + 1, min(kept + saves - 1, keep) + 1)
    one = checkpoint_bytes(cfg)
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
