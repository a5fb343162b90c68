"""RewardSet: every reward of a run, one call per step: samples in, a frozen record out.

    rewards = RewardSet.from_config(cfg.reward, task, callables=reward_funcs)
    scored = rewards.score(samples, step=step, max_steps=cfg.run.steps)
    scored.totals          # one float per sample: the weighted sum the update trains on
    scored.metrics_row()   # reward/<name>, accuracy, format_rate, timing_s/reward, ...
    rewards.close()        # the worker pool, when reward.workers > 0

The total is combined as TRL combines it (nansum), in float64: None (no reward from a
function for that sample) is skipped, the others are weighted and summed; a sample every
function left None totals 0.0 and is marked in `unscorable`. With no function configured
the task's own grader alone scores, so a run gives exactly the rewards `Task.reward` gives.

`reward.workers: N` scores the functions named by spec (FILE.py or module) in N processes
(spawned, each loading the functions again by spec; contiguous chunks of the samples, one per
worker, results in sample order): slow verifiers run side by side. Built-ins and functions
passed from Python run in this process, one after another. A TRL-style function that looks
across the whole batch (or calls log_metric) sees one chunk at a time under a pool.
"""

from __future__ import annotations

import math
import multiprocessing
import time
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from handoff.config import RewardConfig
from handoff.errors import HandoffError
from handoff.rewards.builtin import builtin
from handoff.rewards.calling import (RESERVED, CallResult, RewardInputs, call_builtin,
                                     call_user_function, check_reward_range, named_samples)
from handoff.rewards.loading import (BUILTIN, BUILTIN_PREFIX, RewardFunction, first_line,
                                     from_callable, from_spec, resolve_spec)
from handoff.tasks import Problem, Task


@dataclass(frozen=True)
class Sample:
    """One completion to score, with the problem (and its dataset columns) it answers."""

    problem: Problem
    prompt: str | Sequence[Mapping[str, str]]  # what the model was given: text or chat messages
    completion: str  # the decoded completion
    completion_ids: Sequence[int]

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


@dataclass(frozen=True)
class StepRewards:
    """A step's rewards: totals to train on, each function's values, what to log."""

    totals: tuple[float, ...]
    per_function: Mapping[str, tuple[float | None, ...]]  # reward/<name>, in function order
    correct: tuple[bool | None, ...]  # from the first built-in grader; None: no grader
    formatted: tuple[bool | None, ...]
    unscorable: tuple[bool, ...]  # every function gave None (TRL zeroes its advantage)
    seconds: float  # timing_s/reward
    extra_columns: Mapping[str, list[Any]]  # TRL's log_extra(column, values)
    logged: Mapping[str, float]  # TRL's log_metric(name, value), averaged over its calls

    def metrics_row(self) -> dict[str, float]:
        """Means for the step's metrics row: reward/<name> over the samples it scored,
        accuracy and format_rate where a grader gave them, timing_s/reward, logged metrics."""
        row = {}
        for name, values in self.per_function.items():
            given = [v for v in values if v is not None]
            if given:
                row[f"reward/{name}"] = sum(given) / len(given)
        for key, flags in (("accuracy", self.correct), ("format_rate", self.formatted)):
            known = [f for f in flags if f is not None]
            if known:
                row[key] = sum(known) / len(known)
        row["timing_s/reward"] = self.seconds
        row.update(self.logged)
        return row


class RewardWarning(UserWarning):
    """A reward's values that train nothing (every sample unscored)."""


class RewardSet:
    """The run's reward functions with their weights; `score` rewards one step's samples."""

    def __init__(self, functions: Sequence[RewardFunction], weights: Sequence[float] | None = None,
                 *, workers: int = 0, rank: int | None = None) -> None:
        """`rank`: this process's rank under torchrun (None alone), named with a sample in
        an error line: each rank numbers its own samples from 0."""
        if not functions:
            raise HandoffError("no reward function: name one in reward.functions (or leave it "
                               "empty for the task's own grader)")
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        if len(weights) != len(functions):
            raise HandoffError(f"reward.weights has {len(weights)} value(s) for "
                               f"{len(functions)} reward functions: give one weight per "
                               "function, in order (or none: all 1.0)")
        if not all(math.isfinite(w) for w in weights):
            raise HandoffError(f"reward.weights={weights}: every weight must be a finite number")
        self.functions = _unique_names(functions)
        self.weights = tuple(weights)
        self.workers = workers
        self.rank = rank
        self._pool: ProcessPoolExecutor | None = None
        self._warned_unscored = False

    @classmethod
    def from_config(cls, reward: RewardConfig, task: Task, *,
                    callables: Sequence[Callable[..., Any]] = (),
                    rank: int | None = None) -> RewardSet:
        """`reward.functions` by spec, then `callables` from Python; the task's grader when
        there are neither. `reward.weights` covers both, in that order."""
        functions = [builtin(s, task) if s.strip().startswith(BUILTIN_PREFIX) else from_spec(s)
                     for s in reward.functions]
        functions += [from_callable(fn) for fn in callables]
        if not functions:
            functions = [builtin(BUILTIN_PREFIX + "task", task)]
        graders = [f for f in functions if f.style == BUILTIN]
        if graders and not task.has_answers:
            raise HandoffError(f"{BUILTIN_PREFIX}{graders[0].name} grades against a reference "
                               "answer and data.answer_field is null (prompts only): set "
                               "data.answer_field, or score with reward.functions of your own")
        return cls(functions, reward.weights, workers=reward.workers, rank=rank)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    def score(self, samples: Sequence[Sample], *, step: int = 0,
              max_steps: int = 0) -> StepRewards:
        """Every function on every sample; HandoffError naming the function, the sample and
        the value when one raises or returns what is not a finite float (or None)."""
        started = time.perf_counter()
        inputs = reward_inputs(samples, step=step, max_steps=max_steps, rank=self.rank)
        flags = None  # (correct, formatted) per sample, from the first built-in grader
        results: dict[int, CallResult] = {}
        pending = {i: self._submit(f, inputs) for i, f in enumerate(self.functions)
                   if f.spec is not None and self.workers > 0}
        for i, f in enumerate(self.functions):
            if f.style == BUILTIN:
                scores = [call_builtin(f.fn, f.name, s.problem, s.completion, inputs.named(k))
                          for k, s in enumerate(samples)]
                results[i] = CallResult([r for r, _, _ in scores])
                if flags is None:
                    flags = tuple(c for _, c, _ in scores), tuple(m for _, _, m in scores)
            elif i not in pending:
                results[i] = call_user_function(f.fn, f.style, f.name, inputs, 0)
        for i, futures in pending.items():
            results[i] = _joined([_result(future, self.functions[i].name) for future in futures])
        ordered = [results[i] for i in range(len(self.functions))]
        totals, unscorable = weighted_totals([r.values for r in ordered], self.weights,
                                             rank=self.rank)
        if unscorable and all(unscorable) and not self._warned_unscored:
            self._warned_unscored = True   # once a run: TRL warns too, and scores them 0
            names = ", ".join(f.name for f in self.functions)
            warnings.warn(f"every reward function ({names}) returned None for every sample: "
                          "they are scored 0 and the step learns nothing; return a float for "
                          "the samples a function can score", RewardWarning, stacklevel=2)
        merged = _joined(ordered)
        correct, formatted = flags or ((None,) * len(samples),) * 2
        return StepRewards(
            totals, {f.name: tuple(r.values) for f, r in zip(self.functions, ordered)},
            correct, formatted, unscorable, time.perf_counter() - started,
            merged.extra_columns, {k: sum(v) / len(v) for k, v in merged.metrics.items()})

    def _submit(self, function: RewardFunction, inputs: RewardInputs) -> list:
        if self._pool is None:
            # spawn, not fork: the parent holds CUDA and threads that a fork would copy.
            self._pool = ProcessPoolExecutor(self.workers,
                                             mp_context=multiprocessing.get_context("spawn"))
        bounds = [len(inputs) * w // self.workers for w in range(self.workers + 1)]
        return [self._pool.submit(_call_by_spec, function.spec, function.style, function.name,
                                  inputs.slice(a, b), a)
                for a, b in zip(bounds, bounds[1:]) if b > a]

    def close(self) -> None:
        """Stop the worker pool (a no-op without one)."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def weighted_totals(values: Sequence[Sequence[float | None]], weights: Sequence[float], *,
                    rank: int | None = None) -> tuple[tuple[float, ...], tuple[bool, ...]]:
    """Per sample, the weighted sum of the functions' values with None skipped (TRL's nansum),
    and whether every function gave None (then the total is 0.0); `rank` as RewardSet's."""
    totals, unscorable = [], []
    for per_sample in zip(*values):
        given = [(w, v) for w, v in zip(weights, per_sample) if v is not None]
        # Started from the first term, not 0: one function of weight 1 gives its value
        # bit for bit (the task's grader alone gives exactly Task.reward's floats).
        totals.append(sum((w * v for w, v in given[1:]), given[0][0] * given[0][1])
                      if given else 0.0)
        sample = named_samples(len(totals) - 1, rank=rank)
        check_reward_range(totals[-1], f"the weighted total of {sample} is {totals[-1]:g} "
                                       f"(reward.weights {list(weights)})")
        unscorable.append(not given)
    return tuple(totals), tuple(unscorable)


def reward_inputs(samples: Sequence[Sample], *, step: int = 0, max_steps: int = 0,
                  rank: int | None = None) -> RewardInputs:
    """The samples as TRL and verl read them (see calling.py and dataset_columns)."""
    columns_per_sample = [dataset_columns(s.problem) for s in samples]
    keys = list(dict.fromkeys(k for cols in columns_per_sample for k in cols))
    columns = {k: [cols.get(k) for cols in columns_per_sample] for k in keys if k not in RESERVED}
    completions = [[{"role": "assistant", "content": s.completion}] if s.chat else s.completion
                   for s in samples]
    prompts = [list(s.prompt) if s.chat else s.prompt for s in samples]
    return RewardInputs(
        prompts, completions, [s.completion for s in samples],
        [list(s.completion_ids) for s in samples], columns,
        data_sources=[cols.get("data_source") for cols in columns_per_sample],
        ground_truths=[_ground_truth(s.problem, cols)
                       for s, cols in zip(samples, columns_per_sample)],
        extra_infos=[cols.get("extra_info") or {} for cols in columns_per_sample],
        step=step, max_steps=max_steps, rank=rank)


def dataset_columns(problem: Problem) -> dict[str, Any]:
    """A problem's columns for the rewards: the dataset's own (every field but the prompt)
    when the task keeps them, else the task's metadata plus `answer` (arithmetic: a, op, b)."""
    if "columns" in problem.metadata:
        return dict(problem.metadata["columns"])
    return {**problem.metadata, "answer": problem.answer}


def _ground_truth(problem: Problem, columns: Mapping[str, Any]) -> Any:
    """verl's ground truth: reward_model.ground_truth, else a ground_truth column, else the
    task's reference answer (None for prompts alone: data.answer_field=null)."""
    reward_model = columns.get("reward_model")
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    return columns.get("ground_truth", problem.answer or None)


def _call_by_spec(spec: str, style: str, name: str, inputs: RewardInputs,
                  start: int) -> CallResult:
    """Runs in a pool worker: load the function by its spec (once per worker) and call it."""
    return call_user_function(resolve_spec(spec), style, name, inputs, start)


def _result(future: Future, name: str) -> CallResult:
    """A worker's result; a worker that died or a result that could not come back is one line."""
    try:
        return future.result()
    except HandoffError:
        raise
    except Exception as e:  # BrokenProcessPool, a value that does not pickle, ...
        raise HandoffError(f"reward {name} failed in a reward.workers process "
                           f"({type(e).__name__}: {first_line(e)}): "
                           "fix the function or run it in process (reward.workers=0)") from e


def _joined(parts: Sequence[CallResult]) -> CallResult:
    """Values end to end (a function's chunks, in sample order); logs merged."""
    out = CallResult([v for part in parts for v in part.values])
    for part in parts:
        for key, values in part.extra_columns.items():
            out.extra_columns.setdefault(key, []).extend(values)
        for key, values in part.metrics.items():
            out.metrics.setdefault(key, []).extend(values)
    return out


def _unique_names(functions: Sequence[RewardFunction]) -> list[RewardFunction]:
    """Two functions of one name get _2, _3 suffixes, so each has its own reward/<name>."""
    seen: dict[str, int] = {}
    out = []
    for f in functions:
        seen[f.name] = seen.get(f.name, 0) + 1
        name = f.name if seen[f.name] == 1 else f"{f.name}_{seen[f.name]}"
        out.append(RewardFunction(name, f.fn, f.style, f.spec))
    return out
