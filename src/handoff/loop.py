"""The step driver: sync GRPO on one HybridWorker per process (`handoff train CONFIG`).

    summary = train(load_config("examples/cpu-demo.yaml"))

One step: prompts from the task -> worker.generate (n samples each) -> rewards ->
worker.to_train -> old and ref log-probs -> worker.update -> worker.to_rollout (the switch
and the weight sync). Every step appends one JSON object to `metrics.jsonl` (and TensorBoard
scalars), with `switch/<action>/seconds` and `/bytes` for each ledger action; the run ends
with `summary.md` (planned vs measured per action), `memory_timeline.jsonl/.png`.
`timing_s/step` includes a checkpoint save, which `timing_s/checkpoint` reports on its own
(0 on a step that saves nothing).

Under torchrun every rank runs this loop on its share of the step's prompts (data parallel);
the trainer's FSDP2 group spans all ranks, rewards are averaged over ranks, and rank 0
writes the files. With parallel.tp > 1 the ranks of a TP group share one engine: they
generate their prompts together and each trains on its own share. Prompt i of a step is
sampled with a seed from (run.seed, step, i), so a run gives the same samples on 1 or 2 ranks
and after a resume.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from handoff.config import Config
from handoff.errors import HandoffError
from handoff.memory import frozen_gc_heap
from handoff.rollout.parallel import world_rank_size
from handoff.rollout.sampling import SamplingParams
from handoff.run_dir import claim_out_dir, trim_metrics, write_run_config
from handoff.run_report import RunReport, console
from handoff.tasks import build_task
from handoff.train.batch import RolloutBatch
from handoff.train.checkpoint import (latest_checkpoint, load_checkpoint, publish_checkpoint,
                                     save_checkpoint)
from handoff.train.dist import all_reduce_
from handoff.worker import HybridWorker


def _prompt_seed(seed: int, step: int, index: int) -> int:
    return (seed * 1_000_003 + step) * 1_000_033 + index


def _mean_over_ranks(values: list[float]) -> tuple[float, float, int]:
    """(mean, std, count) of per-sample values gathered over every rank."""
    _, world = world_rank_size()
    # NCCL reduces device tensors only; gloo (CPU runs) host ones.
    nccl = world > 1 and torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor([sum(values), sum(v * v for v in values), len(values)], dtype=torch.float64,
                     device=device)
    if world > 1:
        t = all_reduce_(t)
    total, sq, n = t.tolist()
    mean = total / max(n, 1)
    return mean, max(sq / max(n, 1) - mean * mean, 0.0) ** 0.5, int(n)


def check_finite_update(update: dict, step: int) -> None:
    """Stop before a non-finite loss or gradient norm reaches the weights' checkpoint."""
    bad = [k for k in ("loss", "grad_norm") if k in update and not math.isfinite(update[k])]
    if bad:
        raise HandoffError(f"step {step} gave a non-finite {bad[0]} ({update[bad[0]]}): the "
                           "weights are no longer trustworthy and no checkpoint of them is "
                           "written; resume from the last checkpoint with a lower actor.lr")


class Trainer:
    """Owns the worker, the task, the tokenizer and the output files of one run."""

    def __init__(self, cfg: Config):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.rank, self.world = world_rank_size()
        self.out_dir = Path(cfg.run.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.run_lock = None
        if self.rank == 0:   # refuses a used out_dir or a live run's before any work
            self.run_lock = claim_out_dir(cfg)
        else:  # one voice per run: rank 0 prints, the others load their models quietly
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        torch.manual_seed(cfg.run.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.task = build_task(cfg.data, seed=cfg.run.seed)
        self.worker = HybridWorker(cfg)
        self.pad_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                       else self.tokenizer.eos_token_id)
        self.start_step = 0
        self.pending_checkpoint: Path | None = None
        if cfg.run.resume:
            self._resume()
        if self.rank == 0:
            trim_metrics(self.out_dir, self.start_step)
        self.report = RunReport(cfg, self.worker, self.out_dir) if self.rank == 0 else None

    # ---------------------------------------------------------------- checkpoints

    def _resume(self) -> None:
        """Continue from the last complete checkpoint (a fresh start when there is none)."""
        if latest_checkpoint(self.ckpt_dir) is None:
            if self.rank == 0:  # said out loud: a killed run with no checkpoint restarts at 0
                console.print(f"[yellow]resume: no complete checkpoint in {self.ckpt_dir}: "
                              "starting at step 0[/]", highlight=False)
            return
        state = self.worker.load_trainer_state(lambda actor: load_checkpoint(self.ckpt_dir, actor))
        task_state = state["extra"].get("task") if isinstance(state["extra"], dict) else None
        if not isinstance(task_state, dict):
            raise HandoffError(f"{state['path']}/meta.json records no data position (extra.task): "
                               "it was not written by `handoff train`; start over with --overwrite")
        self.start_step = int(state["step"])
        self.task.load_state_dict(task_state)

    def _save(self, step: int) -> Path:
        """Write checkpoint `step` unpublished: it counts once its metrics row is written."""
        return save_checkpoint(self.ckpt_dir, self.worker.actor, step=step,
                               extra={"task": self.task.state_dict()}, publish=False)

    # ---------------------------------------------------------------- one step

    def _prompts(self, step: int) -> tuple[list, list[list[int]], list[int]]:
        """The problems this rank's engine generates, their token ids and global indices.

        Rank r trains on prompts i with i % world == r; a TP group of ranks [g*tp, (g+1)*tp)
        shares one engine, so every rank of it generates the prompts of all its ranks."""
        problems = self.task.sample(self.cfg.data.prompts_per_step)
        tp = self.worker.engine.tp.size
        indices = [i for i in range(len(problems)) if i % self.world // tp == self.rank // tp]
        mine = [problems[i] for i in indices]
        ids = [self.task.encode_prompt(p, self.tokenizer, chat=self.cfg.data.chat_template)
               for p in mine]
        return mine, ids, indices

    def step(self, step: int, *, save: bool = False) -> dict:
        """One GRPO step; with `save`, checkpoint after the update (trainer state on device)."""
        cfg, worker = self.cfg, self.worker
        worker.begin_step(step)
        t_step = time.perf_counter()
        problems, prompt_ids, indices = self._prompts(step)
        params = [SamplingParams.from_config(cfg.rollout, seed=_prompt_seed(cfg.run.seed, step, i))
                  for i in indices]
        t0 = time.perf_counter()
        outs = worker.generate(prompt_ids, params)
        gen_seconds = time.perf_counter() - t0
        prompts_rep, responses, rewards, lengths = [], [], [], []
        for problem, ids, out, index in zip(problems, prompt_ids, outs, indices):
            if index % self.world != self.rank:
                continue  # generated for another rank of this TP group, which trains on it
            for sample in out.outputs:
                text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
                prompts_rep.append(ids)
                responses.append(sample.token_ids)
                rewards.append(float(self.task.reward(problem, text)))
                lengths.append(len(sample.token_ids))
        batch = RolloutBatch.from_tokens(prompts_rep, responses, rewards,
                                         group_size=cfg.rollout.n, pad_id=self.pad_id)
        batch = batch.to(worker.device)
        worker.to_train()
        t0 = time.perf_counter()
        batch.old_logprobs = worker.old_log_probs(batch)
        batch.ref_logprobs = worker.ref_log_probs(batch)
        update = worker.update(batch)
        train_seconds = time.perf_counter() - t0
        check_finite_update(update, step + 1)   # before a checkpoint could keep NaN weights
        t0 = time.perf_counter()
        self.pending_checkpoint = self._save(step + 1) if save else None
        checkpoint_seconds = time.perf_counter() - t0 if save else 0.0
        sync = worker.to_rollout()
        step_seconds = time.perf_counter() - t_step
        reward_mean, reward_std, _ = _mean_over_ranks(rewards)
        length_mean, _, _ = _mean_over_ranks([float(x) for x in lengths])
        tokens, _, _ = _mean_over_ranks([float(sum(lengths))])
        row = {
            "step": step + 1, "reward_mean": reward_mean, "reward_std": reward_std,
            "response_length": length_mean, **{k: float(v) for k, v in update.items()},
            "timing_s/gen": gen_seconds, "timing_s/train": train_seconds,
            "timing_s/step": step_seconds, "timing_s/checkpoint": checkpoint_seconds,
            "tokens_per_s": tokens * self.world / gen_seconds,
            "sync/bytes": sync.bytes, "sync/buckets": sync.num_buckets,
            "sync/bound_extra_bytes": sync.bound_extra_bytes,
            # The sync action's parts: mapping the weights, then the copies (host: until
            # the last bucket was handed over; the rest waits for the device).
            "sync/wake_s": worker.last_wake_seconds, "sync/host_s": sync.host_seconds,
            "sync/copy_s": sync.seconds,
        }
        if sync.measured_peak_extra_bytes is not None:
            row["sync/measured_peak_extra_bytes"] = sync.measured_peak_extra_bytes
        for action, rec in worker.actions.items():
            row[f"switch/{action}/seconds"] = rec["seconds"]
            row[f"switch/{action}/bytes"] = rec["bytes"]
            if rec["seconds"] > 0 and rec["bytes"] > 0:
                row[f"switch/{action}/gbps"] = rec["bytes"] / rec["seconds"] / 1e9
        return row

    # ---------------------------------------------------------------- the run

    def run(self) -> dict:
        cfg = self.cfg
        if self.start_step >= cfg.run.steps:
            raise HandoffError(f"the checkpoint in {self.ckpt_dir} is at step {self.start_step}, "
                               f"run.steps={cfg.run.steps}: raise run.steps to train further")
        if self.report is not None:
            self.report.start(self.start_step)
        with frozen_gc_heap():   # the switch's gc.collect() calls skip the setup's objects
            for step in range(self.start_step, cfg.run.steps):
                done = step + 1
                save = cfg.run.checkpoint and (done == cfg.run.steps or bool(
                    cfg.run.save_every and done % cfg.run.save_every == 0))
                row = self.step(step, save=save)
                if self.report is not None:
                    self.report.log_step(row)
                if self.pending_checkpoint is not None:
                    publish_checkpoint(self.pending_checkpoint)
        return self.report.finish() if self.report is not None else {}


def train(cfg: Config) -> dict:
    """Run `cfg` to the end; returns the summary (rank 0; {} elsewhere)."""
    trainer = Trainer(cfg)
    try:
        if trainer.rank == 0:   # after the resume: a failed one leaves the run's config as it was
            write_run_config(cfg)
        return trainer.run()
    finally:
        if trainer.run_lock is not None:   # the run is over: out_dir is free for the next
            trainer.run_lock.release()
