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
step's when the run ends, in no row). With compiled layers (actor.compile) `actor/compiles`
counts the graphs torch.compile built during the step: the first step's compile, later a
recompile (a new input shape or kind) that the step paid for.

Under torchrun every rank runs this loop on its share of the step's prompts (data parallel);
the trainer's FSDP2 group spans all ranks, rewards are averaged over ranks, and rank 0
writes the files. With parallel.tp > 1 the ranks of a TP group share one engine: they
generate their prompts together and each trains on its own share. Prompt i of a step is
sampled with a seed from (run.seed, step, i), so a run gives the same samples on 1 or 2 ranks
and after a resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence
from pathlib import Path

import torch

from handoff import compile_cache
from handoff.config import Config
from handoff.dist import broadcast_object, mean_over_ranks, world_rank_size
from handoff.errors import HandoffError
from handoff.lengths import ResponseLengths
from handoff.memory.allocator import frozen_gc_heap
from handoff.rollout.sampling import SamplingParams, seeded_per_prompt
from handoff.run_dir import (claim_out_dir, clear_earlier_run, keep_changed_config,
                             resume_point, trim_metrics, write_run_config)
from handoff.run_report import RunReport, console
from handoff.rewards import RewardSet, Sample
from handoff.runplan import RunPlan
from handoff.startup import start_worker
from handoff.tasks import build_eval_problems, build_task
from handoff.tasks.base import checkpoint_task_state
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.compiled import compiles_so_far, layers_compiled
from handoff.trainer.checkpoint import (checkpoint_meta, load_checkpoint, publish_checkpoint,
                                     save_checkpoint)
from handoff.switch import Generation, StepTimes, SwitchRecord



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
    reward_metrics: dict[str, float]   # RewardSet's: reward/<name>, accuracy, format_rate, ...
    texts: list[tuple[str, str]]       # (prompt, completion) of every sample, in order


@dataclass(frozen=True)
class HostTimes:
    """The loop's own clock of a step: its wall seconds, the part spent saving a checkpoint,
    the trainer's wall seconds (log-probs and update), and its host work outside the worker
    (sampling the prompts, scoring the responses: exposed, no device works meanwhile)."""

    step_s: float
    checkpoint_s: float
    train_s: float
    host_s: float


def step_row(step: int, scored: Scored, update: dict[str, float], gen: Generation,
             switch: SwitchRecord, times: StepTimes, host: HostTimes, *, world: int,
             copy_bps: float = 0.0) -> dict:
    """The step's metrics row: rewards and lengths averaged over every rank; the engine's
    numbers (`gen.engine`: its stats after the step's generation, this step's share of its
    counters; its decode against its HBM floor, what it read at the least over the card's
    copy rate `copy_bps`, when measured), `times` (the worker's clock) and train_tokens (the
    prompt + response tokens trained on) are this rank's."""
    reward_mean, reward_std, _ = mean_over_ranks(scored.rewards)
    length_mean, _, _ = mean_over_ranks([float(x) for x in scored.lengths])
    tokens, _, _ = mean_over_ranks([float(sum(scored.lengths))])
    prompt_mean, _, _ = mean_over_ranks([float(n) for n in scored.prompt_lengths])
    sync, engine = switch.sync, gen.engine
    row = {
        "step": step + 1, "reward_mean": reward_mean, "reward_std": reward_std,
        "response_length": length_mean, **{k: float(v) for k, v in update.items()},
        **scored.reward_metrics,
        "timing_s/gen": gen.seconds, "timing_s/train": host.train_s,
        "timing_s/step": host.step_s, "timing_s/checkpoint": host.checkpoint_s,
        "timing_s/host": host.host_s,
        "tokens_per_s": tokens * world / gen.seconds,
        "switch/exposed_s": host.step_s - host.checkpoint_s - times.work_s,
        "switch/copy_wait_s": times.copy_wait_s, "switch/flush_s": times.flush_s,
        "switch/queue_s": times.queue_s, "switch/gemms_warmed": times.gemms_warmed,
        **{f"work_s/{phase}": seconds for phase, seconds in times.work.items()},
        "switch/raw_s": switch.raw_seconds,
        "train_tokens": sum(scored.prompt_lengths) + sum(scored.lengths),
        # The full tensors streamed through this card's buckets (every rank all of them);
        # switch/engine_weights_sync/bytes is what its engine keeps (its TP shard).
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
        "engine/decode_read_bytes": engine["decode_read_bytes"],
        # Allocations that flushed torch's cache (a device sync each): the step ran short.
        "memory/alloc_retries": times.alloc_retries,
    }
    if copy_bps and engine["decode_read_bytes"]:
        row["engine/decode_over_floor"] = engine["decode_seconds"] / (
            engine["decode_read_bytes"] / copy_bps)
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
    if bad and step == 1:   # no update has run yet: the model's own weights are the suspect
        raise HandoffError(f"step 1 gave a non-finite {bad[0]} ({update[bad[0]]}) before any "
                           "update: check model.path's weights for NaN or inf values (a "
                           "damaged or wrongly converted checkpoint); nothing was checkpointed")
    if bad:
        raise HandoffError(f"step {step} gave a non-finite {bad[0]} ({update[bad[0]]}): the "
                           "weights are no longer trustworthy and no checkpoint of them is "
                           "written; resume from the last checkpoint with a lower actor.lr")


class Run:
    """One training run: the worker, the task, the tokenizer and the output files."""

    def __init__(self, cfg: Config, plan: RunPlan | None = None, *,
                 reward_funcs: Sequence[Callable] = ()):
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
        try:
            self._start(cfg, plan, reward_funcs)
        except BaseException:
            if self.run_lock is not None:   # a refused start: out_dir as it was
                self.run_lock.release(failed_start=True)
            raise

    def _start(self, cfg: Config, plan: RunPlan | None, reward_funcs: Sequence[Callable]):
        from transformers import AutoTokenizer

        torch.manual_seed(cfg.run.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=False)
        self.task = build_task(cfg.data, seed=cfg.run.seed)
        self.rewards = RewardSet.from_config(cfg.reward, self.task, callables=reward_funcs,
                                             rank=self.rank if self.world > 1 else None)
        self.eval_set = build_eval_problems(cfg.data, cfg.eval, seed=cfg.run.seed)
        self.samples: list[tuple[str, str, float]] = []   # the last step's, for the report
        self.plan = plan or RunPlan.build(cfg)
        self.worker, self.rates = start_worker(cfg, self.plan)
        self.compiled = layers_compiled(self.worker.actor.module)
        self.pad_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                       else self.tokenizer.eos_token_id)
        self.start_step = 0
        self.pending_checkpoint: Path | None = None
        if cfg.run.resume:
            self._resume()
        if self.rank == 0:   # every check passed: --overwrite may remove the earlier run now
            clear_earlier_run(cfg)
        self.report = (RunReport(self.plan, self.out_dir, rates=self.rates, meter=self.worker.meter,
                                 kv_pool_bytes=self.worker.kv_pool_bytes,
                                 rows=trim_metrics(self.out_dir, self.start_step))
                       if self.rank == 0 else None)

    # ---------------------------------------------------------------- checkpoints

    def _resume(self) -> None:
        """Continue from the last complete checkpoint (a fresh start when there is none)."""
        # Chosen on rank 0: a directory listing may differ between nodes.
        path, stand_in = broadcast_object(resume_point(self.out_dir) if self.rank == 0 else None)
        if path is None:
            if self.rank == 0:  # said out loud: a killed run with no checkpoint restarts at 0
                console.print(f"resume: no complete checkpoint in {self.ckpt_dir}: starting at "
                              "step 0", style="yellow", markup=False, highlight=False)
            return
        if stand_in and self.rank == 0:
            console.print(f"resume: {self.ckpt_dir / 'latest'} is missing: continuing from the "
                          f"newest complete checkpoint, {path.name}", style="yellow",
                          markup=False, highlight=False)
        # checked before any tensor is read
        task_state = checkpoint_task_state(checkpoint_meta(path), f"{path / 'meta.json'}")
        state = self.worker.load_trainer_state(
            lambda actor: load_checkpoint(self.ckpt_dir, actor, path=path))
        self.start_step = int(state["step"])
        self.task.load_state_dict(task_state)

    def _save(self, step: int) -> Path:
        """Write checkpoint `step` unpublished: it counts once its metrics row is written."""
        return self.worker.save_trainer_state(lambda actor: save_checkpoint(
            self.ckpt_dir, actor, step=step, extra={"task": self.task.state_dict()},
            publish=False))

    # ---------------------------------------------------------------- one step

    @staticmethod
    def _reward_prompt(problem) -> str | list:
        """The prompt as reward functions get it, in the data's form as TRL passes it: the
        chat messages for a conversational record, else the text (a text prompt rendered
        with the chat template stays text: the function reads what the data holds)."""
        return list(problem.messages) if problem.conversational else problem.prompt

    def _score(self, step: int, problems: list, prompt_ids: list[list[int]],
               indices: list[int], outs: list) -> Scored:
        """Reward every sample this rank trains on (RewardSet); the batch on the worker's
        device. A reward function that fails stops the step here, before any training: the
        last checkpoint is the run's state."""
        prompts_rep, responses, samples, texts = [], [], [], []
        for problem, ids, out, index in zip(problems, prompt_ids, outs, indices):
            if index % self.world != self.rank:
                continue  # generated for another rank of this TP group, which trains on it
            prompt = self._reward_prompt(problem)
            for sample in out.outputs:
                text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
                prompts_rep.append(ids)
                responses.append(sample.token_ids)
                samples.append(Sample(problem, prompt, text, sample.token_ids))
                texts.append((problem.prompt, text))
        scored = self.rewards.score(samples, step=step, max_steps=self.cfg.run.steps)
        rewards = list(scored.totals)
        batch = RolloutBatch.from_tokens(prompts_rep, responses, rewards,
                                         group_size=self.cfg.rollout.n, pad_id=self.pad_id)
        return Scored(batch.to(self.worker.device), rewards, [len(r) for r in responses],
                      [len(ids) for ids in prompts_rep], scored.metrics_row(), texts)

    def step(self, step: int, *, save: bool = False) -> dict:
        """One GRPO step; with `save`, checkpoint after the update (trainer state on device)."""
        worker = self.worker
        worker.begin_step(step)
        t_step = time.perf_counter()
        compiles = compiles_so_far() if self.compiled else 0   # an eager run skips dynamo
        problems, prompt_ids, indices, params = step_prompts(
            self.cfg, self.task, self.tokenizer, step, rank=self.rank, world=self.world,
            tp=worker.tp_size)
        host_s = time.perf_counter() - t_step
        gen = worker.generate(prompt_ids, params)
        t0 = time.perf_counter()
        scored = self._score(step, problems, prompt_ids, indices, gen.outputs)
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
        switch, times = worker.end_step([to_train, ref_moves, optimizer_moves, to_rollout])
        host = HostTimes(step_s=time.perf_counter() - t_step, checkpoint_s=checkpoint_s,
                         train_s=train_s, host_s=host_s)
        # The first sample of every prompt first: the few the report keeps cover many prompts.
        n = self.cfg.rollout.n
        order = sorted(range(len(scored.rewards)), key=lambda i: (i % n, i))
        self.samples = [(*scored.texts[i], scored.rewards[i]) for i in order]
        row = step_row(step, scored, update, gen, switch, times, host, world=self.world,
                       copy_bps=self.rates.get("d2d_bps", 0.0))
        if self.compiled:
            row["actor/compiles"] = compiles_so_far() - compiles
            if row["actor/compiles"]:   # the next run of this shape is priced warm
                compile_cache.mark_warm(compile_cache.layer_key(self.plan.shape,
                                                                self.cfg.model.dtype))
        return row

    def evaluate(self) -> dict[str, float]:
        """The evaluation set (data.eval_path, or arithmetic's held-out stream), one sample
        each at eval.temperature (0: greedy), scored by the run's rewards: eval/reward_mean,
        eval/accuracy and eval/format_rate where a grader gives them, averaged over ranks.
        Runs in the rollout phase, between two steps."""
        task, problems = self.eval_set
        cfg = self.cfg
        params = SamplingParams.from_config(cfg.rollout, seed=cfg.run.seed)
        params = dataclasses.replace(params, n=1, temperature=cfg.eval.temperature,
                                     sample_max_tokens=())
        tp = self.worker.tp_size
        mine = [i for i in range(len(problems)) if i % self.world // tp == self.rank // tp]
        ids = [task.encode_prompt(problems[i], self.tokenizer, chat=cfg.data.chat_template)
               for i in mine]
        # a seed per problem from its index in the set, whatever the ranks
        outs = self.worker.generate(ids, seeded_per_prompt(params, cfg.run.seed, mine)).outputs
        self.worker.reset_prefix_cache()
        samples = [Sample(problems[i], self._reward_prompt(problems[i]),
                          self.tokenizer.decode(out.outputs[0].token_ids,
                                                skip_special_tokens=True),
                          out.outputs[0].token_ids)
                   for i, out in zip(mine, outs) if i % self.world == self.rank]
        scored = self.rewards.score(samples) if samples else None
        row = {"eval/reward_mean": mean_over_ranks(list(scored.totals) if scored else [])[0]}
        for key, flags in (("accuracy", "correct"), ("format_rate", "formatted")):
            known = [float(f) for f in getattr(scored, flags, ()) if f is not None]
            value, _, count = mean_over_ranks(known)
            if count:
                row[f"eval/{key}"] = value
        return row

    # ---------------------------------------------------------------- the run

    def run(self) -> dict:
        cfg = self.cfg
        if self.start_step > cfg.run.steps:   # at run.steps: a run killed before its summary
            raise HandoffError(f"the checkpoint in {self.ckpt_dir} is at step {self.start_step}, "
                               f"run.steps={cfg.run.steps}: raise run.steps to train further")
        if self.report is not None:
            try:   # the loggers: the last of the start (wandb may refuse here)
                self.report.start(self.start_step)
            except BaseException:
                if self.run_lock is not None:
                    self.run_lock.release(failed_start=True)
                raise
        try:
            with frozen_gc_heap():   # the switch's gc.collect() calls skip the setup's objects
                for step in range(self.start_step, cfg.run.steps):
                    done = step + 1
                    save = cfg.run.checkpoint and (done == cfg.run.steps or bool(
                        cfg.run.save_every and done % cfg.run.save_every == 0))
                    row = self.step(step, save=save)
                    if self.eval_set and cfg.run.eval_every and (
                            done % cfg.run.eval_every == 0 or done == cfg.run.steps):
                        row.update(self.evaluate())
                    if self.report is not None:
                        self.report.log_step(row)
                        self.report.log_samples(done, self.samples)
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


def train(cfg: Config, *, plan: RunPlan | None = None,
          reward_funcs: Sequence[Callable] = ()) -> dict:
    """Run `cfg` to the end; returns the summary (rank 0; {} elsewhere). `plan`: the run's
    plan when the preflight built it already; `reward_funcs`: reward functions from Python
    (after those reward.functions names, weighted by reward.weights)."""
    run = Run(cfg, plan, reward_funcs=reward_funcs)
    try:
        if run.rank == 0:   # after the resume: a failed one leaves the run's config as it was
            if cfg.run.resume:
                keep_changed_config(cfg, run.start_step)
            write_run_config(cfg)
        return run.run()
    finally:
        run.rewards.close()
        if run.run_lock is not None:   # the run is over: out_dir is free for the next
            run.run_lock.release()
