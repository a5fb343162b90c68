"""Checks `handoff train` makes before any work: is the model there, does the plan fit.

A run that cannot fit should fail in a second with the planner's reasons, not after minutes
of loading with an out-of-memory error on the first wake.
"""

from __future__ import annotations

from pathlib import Path

from handoff.config import Config
from handoff.errors import HandoffError


def preflight(cfg: Config) -> dict | None:
    """Raise HandoffError naming cause and fix when `cfg` cannot run; returns the plan on GPUs."""
    model = Path(cfg.model.path)
    if not (model / "config.json").is_file():
        raise HandoffError(f"model.path={cfg.model.path!r} is not an HF checkpoint directory "
                           "(no config.json): create one with `handoff init-model --preset "
                           "tiny-qwen3 --out DIR` or point model.path at a downloaded model")
    if not any((model / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise HandoffError(f"{model} has no tokenizer files: save the tokenizer next to the "
                           "weights (tokenizer.save_pretrained(DIR))")
    if cfg.data.prompts_per_step % cfg.parallel.gpus:
        raise HandoffError(f"data.prompts_per_step={cfg.data.prompts_per_step} does not split "
                           f"over parallel.gpus={cfg.parallel.gpus} ranks: use a multiple of it")
    if cfg.run.resume:
        _check_resume(cfg)
    if cfg.hardware.name == "cpu":
        return None
    from handoff.plan.report import build_plan

    plan = build_plan(cfg, ref=cfg.actor.kl_coef > 0)
    verdict = plan["verdict"]
    if not verdict["fits"]:
        reasons = "; ".join(verdict["reasons"])
        raise HandoffError(f"the planner says this run cannot fit: {reasons}. Run `handoff plan "
                           f"--config CONFIG` for the full ledger and turn on offloads or lower "
                           "rollout.gpu_memory_utilization")
    return plan


def _check_resume(cfg: Config) -> None:
    """A resume whose checkpoint already reached run.steps fails now, not after loading."""
    import json

    from handoff.train.checkpoint import latest_checkpoint

    ckpt_dir = Path(cfg.run.out_dir) / "checkpoints"
    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        return
    step = json.loads((latest / "meta.json").read_text())["step"]
    if step >= cfg.run.steps:
        raise HandoffError(f"the checkpoint in {ckpt_dir} is at step {step}, "
                           f"run.steps={cfg.run.steps}: raise run.steps to train further")
