"""The step driver: sync GRPO on one HybridWorker per process (`handoff train CONFIG`).

    summary = train(load_config("examples/cpu-demo.yaml"))

One step: generate (n samples per prompt) -> score -> to_train -> log-probs -> update ->
to_rollout -> one row. Every step appends that row to `metrics.jsonl` (and TensorBoard),
with `switch/<action>/seconds` and `/bytes` for each ledger action; the run ends with
`summary.md` (planned vs measured per action) and `memory_timeline.jsonl/.png`.
`timing_s/step` includes a checkpoint save, which `timing_s/checkpoint` reports on its own
(0 on a step that saves nothing). `switch/raw_s` is the sum of the step's ledger actions'
own seconds; `switch/exposed_s` is the step's wall time in which neither the engine
generates nor the trainer computes (a wait for a copy or a map counts, and so does the host
work between them, scoring; a checkpoint save does not): step - checkpoint - generation -
trainer compute. With memory.overlap a copy is counted in the step it lands in: with an
elastic KV pool a step's copies to the host land in the next step's generation (the last
step's when the run ends, in no row).

Under torchrun every rank runs this loop on its share of the step's prompts (data parallel);
the trainer's FSDP2 group spans all ranks, rewards are averaged over ranks, and rank 0
writes the files. With parallel.tp > 1 the ranks of a TP group share one engine: they
generate their prompts together and each trains on its own share. Prompt i of a step is
sampled with a seed from (run.seed, step, i), so a run gives the same samples on 1 or 2 ranks
and after a resume.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from handoff.config import Config
from handoff.dist import mean_over_ranks, world_rank_size
from handoff.errors import HandoffError
from handoff.lengths import ResponseLengths
from handoff.memory.allocator import alloc_retries, frozen_gc_heap
from handoff.rollout.sampling import SamplingParams
from handoff.run_dir import claim_out_dir, trim_metrics, write_run_config
from handoff.run_report import RunReport, console
from handoff.startup import start_worker
from handoff.tasks import build_task
from handoff.train.batch import RolloutBatch
from handoff.train.checkpoint import (latest_checkpoint, load_checkpoint, publish_checkpoint,
                                     save_checkpoint)
from handoff.worker import SwitchRecord


# Engine counters a step row reports as this step's share (stats() gives them since start).
_ENGINE_COUNTERS = ("preemptions", "decode_steps", "decode_seconds", "prefill_seconds")


def _prompt_seed(seed: int, step: int, index: int) -> int:
    return (seed * 1_000_003 + step) * 1_000_033 + index


def sampling_params(rollout, seed: int) -> SamplingParams:
    """One prompt's SamplingParams; with rollout.response_lengths each sample gets its own
    length from the distribution (a function of the prompt's seed), EOS ignored."""
    if rollout.response_lengths is None:
        return SamplingParams.from_config(rollout, seed=seed)
    lengths = ResponseLengths.parse(rollout.response_lengths).draw(seed=seed, count=rollout.n)
    return SamplingParams.from_config(rollout, seed=seed, ignore_eos=True,
                                      sample_max_tokens=[min(n, rollout.max_tokens)
                                                         for n in lengths])


def step_prompts(cfg: Config, task, tokenizer, step: int, *, rank: int = 0, world: int = 1,
                 tp: int = 1) -> tuple[list, list[list[int]], list[int], list[SamplingParams]]:
    """(problems, their prompt ids, their global indices, their SamplingParams) of the prompts
    rank `rank`'s engine generates in step `step` (the task's stream advances by one step).

    Rank r trains on prompts i with i % world == r; a TP group of ranks [g*tp, (g+1)*tp)
    shares one engine, so every rank of it generates the prompts of all its ranks."""
    problems = task.sample(cfg.data.prompts_per_step)
    indices = [i for i in range(len(problems)) if i % world // tp == rank // tp]
    mine = [problems[i] for i in indices]
    ids = [task.encode_prompt(p, tokenizer, chat=cfg.data.chat_template) for p in mine]
    params = [sampling_params(cfg.rollout, _prompt_seed(cfg.run.seed, step, i)) for i in indices]
    return mine, ids, indices, params


@dataclass
class Scored:
    """This rank's samples of one step, scored: the batch to train on and what to log."""

    batch: RolloutBatch
    rewards: list[float]
    lengths: list[int]
    prompt_lengths: list[int]


def step_row(step: int, scored: Scored, update: dict[str, float], switch: SwitchRecord,
             engine: dict, *, world: int, gen_s: float, train_s: float, checkpoint_s: float,
             step_s: float, work: dict[str, float], host_s: float = 0.0,
             flush_s: float = 0.0, copy_wait_s: float = 0.0, queue_s: float = 0.0,
             gemms_warmed: int = 0, alloc_retries: int = 0) -> dict:
    """The step's metrics row (rewards and lengths averaged over every rank; the engine's
    numbers, `engine` = its stats after the step's generate with this step's preemptions,
    are this rank's, and so are `work`, its generation and trainer compute seconds by phase
    (HybridWorker.work), `copy_wait_s`, the compute's waits for copies, `host_s`, the step's
    host work outside the worker (its prompts and their scoring: part of the exposed time),
    `flush_s`, the switch's cache flushes (HybridWorker.flush_seconds: exposed too),
    `queue_s`, the compute's idle time while the host queues the copies back inside it, and
    `gemms_warmed`, the GEMM shapes launched before them (HybridWorker: exposed too), and
    train_tokens, the prompt + response tokens it trained on)."""
    reward_mean, reward_std, _ = mean_over_ranks(scored.rewards)
    length_mean, _, _ = mean_over_ranks([float(x) for x in scored.lengths])
    tokens, _, _ = mean_over_ranks([float(sum(scored.lengths))])
    prompt_mean, _, _ = mean_over_ranks([float(n) for n in scored.prompt_lengths])
    sync = switch.sync
    row = {
        "step": step + 1, "reward_mean": reward_mean, "reward_std": reward_std,
        "response_length": length_mean, **{k: float(v) for k, v in update.items()},
        "timing_s/gen": gen_s, "timing_s/train": train_s, "timing_s/step": step_s,
        "timing_s/checkpoint": checkpoint_s, "timing_s/host": host_s,
        "tokens_per_s": tokens * world / gen_s,
        "switch/exposed_s": step_s - checkpoint_s - sum(work.values()),
        "switch/copy_wait_s": copy_wait_s, "switch/flush_s": flush_s,
        "switch/queue_s": queue_s, "switch/gemms_warmed": gemms_warmed,
        **{f"work_s/{phase}": seconds for phase, seconds in work.items()},
        "switch/raw_s": sum(a.seconds for a in switch.actions.values()),
        "train_tokens": sum(scored.prompt_lengths) + sum(scored.lengths),
        "sync/bytes": sync.bytes, "sync/buckets": sync.num_buckets,
        "sync/bound_extra_bytes": sync.bound_extra_bytes,
        # The sync action's parts: mapping the weights, then the copies (host: until the last
        # bucket was handed over; the rest waits for the device).
        "sync/wake_s": switch.weights_wake_seconds, "sync/host_s": sync.host_seconds,
        "sync/copy_s": sync.seconds,
        "prompt_length": prompt_mean,
        "engine/kv_blocks": engine["usable_blocks"], "engine/kv_bytes": engine["kv_mapped_bytes"],
        "engine/peak_running": engine["peak_running"], "engine/preemptions": engine["preemptions"],
        "engine/decode_steps": engine["decode_steps"],
        "engine/decode_s": engine["decode_seconds"],
        "engine/prefill_s": engine["prefill_seconds"],
        # Allocations that flushed torch's cache (a device sync each): the step ran short.
        "memory/alloc_retries": alloc_retries,
    }
    if sync.verified_buckets:   # sync.verify: every bucket's checksum matched on both sides
        row["sync/verified_buckets"] = sync.verified_buckets
    if sync.measured_peak_extra_bytes is not None:
        row["sync/measured_peak_extra_bytes"] = sync.measured_peak_extra_bytes
    for action, rec in switch.actions.items():
        row[f"switch/{action}/seconds"] = rec.seconds
        row[f"switch/{action}/bytes"] = rec.bytes
        if rec.seconds > 0 and rec.bytes > 0:
            row[f"switch/{action}/gbps"] = rec.bytes / rec.seconds / 1e9
    return row


def check_finite_update(update: dict, step: int) -> None:
    """Stop before a non-finite loss or gradient norm reaches the weights' checkpoint."""
    bad = [k for k in ("loss", "grad_norm") if k in update and not math.isfinite(update[k])]
    if bad:
        raise HandoffError(f"step {step} gave a non-finite {bad[0]} ({update[bad[0]]}): the "
                           "weights are no longer trustworthy and no checkpoint of them is "
                           "written; resume from the last checkpoint with a lower actor.lr")


class Run:
    """One training run: the worker, the task, the tokenizer and the output files."""

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
        self.worker, self.rates = start_worker(cfg)
        self.pad_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                       else self.tokenizer.eos_token_id)
        self.start_step = 0
        self.pending_checkpoint: Path | None = None
        if cfg.run.resume:
            self._resume()
        if self.rank == 0:
            trim_metrics(self.out_dir, self.start_step)
        self.report = (RunReport(cfg, self.out_dir, rates=self.rates, meter=self.worker.meter,
                                 kv_pool_bytes=self.worker.pool.region_bytes("kv_cache"))
                       if self.rank == 0 else None)

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
        self.worker.settle()   # no copy of the trainer's state may still be on its way
        return save_checkpoint(self.ckpt_dir, self.worker.actor, step=step,
                               extra={"task": self.task.state_dict()}, publish=False)

    # ---------------------------------------------------------------- one step

    def _score(self, problems: list, prompt_ids: list[list[int]], indices: list[int],
               outs: list) -> Scored:
        """Reward every sample this rank trains on; the batch on the worker's device."""
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
                                         group_size=self.cfg.rollout.n, pad_id=self.pad_id)
        return Scored(batch.to(self.worker.device), rewards, lengths,
                      [len(ids) for ids in prompts_rep])

    def step(self, step: int, *, save: bool = False) -> dict:
        """One GRPO step; with `save`, checkpoint after the update (trainer state on device)."""
        worker = self.worker
        worker.begin_step(step)
        t_step = time.perf_counter()
        host_s = 0.0   # the step's own host work outside the worker: prompts, then scoring
        problems, prompt_ids, indices, params = step_prompts(
            self.cfg, self.task, self.tokenizer, step, rank=self.rank, world=self.world,
            tp=worker.engine.tp.size)
        host_s += time.perf_counter() - t_step
        before = worker.engine.stats()
        retries = alloc_retries(worker.device)
        t0 = time.perf_counter()
        outs = worker.generate(prompt_ids, params)
        gen_s = time.perf_counter() - t0
        engine = worker.engine.stats()
        for counter in _ENGINE_COUNTERS:   # this step's share of the engine's counters
            engine[counter] -= before[counter]
        t0 = time.perf_counter()
        scored = self._score(problems, prompt_ids, indices, outs)
        host_s += time.perf_counter() - t0
        to_train = worker.to_train()
        t0 = time.perf_counter()
        logprobs, ref_moves = worker.log_probs(scored.batch)
        scored.batch.old_logprobs, scored.batch.ref_logprobs = logprobs["old"], logprobs["ref"]
        update, optimizer_moves = worker.update(scored.batch)
        train_s = time.perf_counter() - t0
        check_finite_update(update, step + 1)   # before a checkpoint could keep NaN weights
        t0 = time.perf_counter()
        self.pending_checkpoint = self._save(step + 1) if save else None
        checkpoint_s = time.perf_counter() - t0 if save else 0.0
        to_rollout = worker.to_rollout()
        switch = SwitchRecord.merged([to_train, ref_moves, optimizer_moves, to_rollout,
                                      worker.take_landed()])
        return step_row(step, scored, update, switch, engine, world=self.world, gen_s=gen_s,
                        train_s=train_s, checkpoint_s=checkpoint_s, host_s=host_s,
                        step_s=time.perf_counter() - t_step, work=worker.work,
                        flush_s=worker.flush_seconds, copy_wait_s=worker.copy_wait_seconds,
                        queue_s=worker.queue_seconds, gemms_warmed=worker.gemms_warmed,
                        alloc_retries=alloc_retries(worker.device) - retries)

    # ---------------------------------------------------------------- the run

    def run(self) -> dict:
        cfg = self.cfg
        if self.start_step > cfg.run.steps:   # at run.steps: a run killed before its summary
            raise HandoffError(f"the checkpoint in {self.ckpt_dir} is at step {self.start_step}, "
                               f"run.steps={cfg.run.steps}: raise run.steps to train further")
        if self.report is not None:
            self.report.start(self.start_step)
        try:
            with frozen_gc_heap():   # the switch's gc.collect() calls skip the setup's objects
                for step in range(self.start_step, cfg.run.steps):
                    done = step + 1
                    save = cfg.run.checkpoint and (done == cfg.run.steps or bool(
                        cfg.run.save_every and done % cfg.run.save_every == 0))
                    row = self.step(step, save=save)
                    if self.report is not None:
                        self.report.log_step(row)
                    if self.pending_checkpoint is not None:
                        publish_checkpoint(self.pending_checkpoint,
                                           keep=cfg.run.keep_checkpoints)
            self.worker.settle()   # the last step's copies to the host land (in no row)
        except BaseException:
            # Who held the card up to the failure (an out-of-memory point of a sweep says
            # which owner did not fit from it).
            if self.rank == 0:   # unless the disk is full: the error being raised says so
                with contextlib.suppress(OSError, HandoffError):
                    self.worker.meter.write_jsonl(self.out_dir / "memory_timeline.jsonl")
            raise
        return self.report.finish() if self.report is not None else {}


def train(cfg: Config) -> dict:
    """Run `cfg` to the end; returns the summary (rank 0; {} elsewhere)."""
    run = Run(cfg)
    try:
        if run.rank == 0:   # after the resume: a failed one leaves the run's config as it was
            write_run_config(cfg)
        return run.run()
    finally:
        if run.run_lock is not None:   # the run is over: out_dir is free for the next
            run.run_lock.release()
