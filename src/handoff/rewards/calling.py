"""Calling one reward function on a step's samples, as its own framework would, and checking
what it returns.

* TRL style: once per batch, by keyword, exactly as TRL 1.x's GRPOTrainer calls it:
  `fn(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=,
  **columns)`, every column a list with one entry per sample. `trainer_state` is a
  `transformers.TrainerState` holding `global_step` and `max_steps`; `log_extra(column,
  values)` and `log_metric(name, value)` collect into the step's record. Returns one float
  or None per sample; an async function is awaited (one event loop per call).
* verl style: once per sample, `fn(data_source=, solution_str=, ground_truth=,
  extra_info=)` (extra_info only when the function takes it), returning a number or a dict
  whose "score" is the reward.
* built-in: once per sample, `grader(problem, completion_text) -> Score`.

Whatever comes back is checked here: a raise, NaN or infinity, a wrong length or a wrong type
is one HandoffError line naming the function, the sample and the value (`named_samples`:
under torchrun each rank numbers its own samples, so the line names the rank too).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from handoff.errors import HandoffError
from handoff.rewards.loading import TRL, VERL, first_line

# The keywords TRL passes itself; a dataset column of one of these names is not passed again.
RESERVED = ("prompt", "completion", "completion_ids", "prompts", "completions", "trainer_state",
            "log_extra", "log_metric")


@dataclass(frozen=True)
class RewardInputs:
    """A step's samples as the three styles read them, one entry per sample (picklable)."""

    prompts: list[Any]  # text, or chat messages
    completions: list[Any]  # text, or [{"role": "assistant", "content": text}] for chat
    completion_texts: list[str]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]  # the dataset's other columns, TRL's **kwargs
    data_sources: list[Any]  # verl's keywords
    ground_truths: list[Any]
    extra_infos: list[Any]
    step: int = 0
    max_steps: int = 0
    rank: int | None = None  # the rank whose batch these are (None: one process)

    def __len__(self) -> int:
        return len(self.completion_texts)

    def slice(self, start: int, stop: int) -> RewardInputs:
        def cut(values: list) -> list:
            return values[start:stop]
        return RewardInputs(cut(self.prompts), cut(self.completions), cut(self.completion_texts),
                            cut(self.completion_ids),
                            {k: cut(v) for k, v in self.columns.items()},
                            cut(self.data_sources), cut(self.ground_truths),
                            cut(self.extra_infos), self.step, self.max_steps, self.rank)

    def named(self, first: int, last: int | None = None) -> str:
        return named_samples(first, last, rank=self.rank)


def named_samples(first: int, last: int | None = None, *, rank: int | None = None) -> str:
    """Sample `first` (to `last`) as an error line names it: its index in this process's
    batch, which under torchrun (`rank` given) every rank numbers from 0 for itself."""
    what = f"sample {first}" if last is None else f"samples {first}..{last}"
    return what if rank is None else f"rank {rank}, {what} of its batch"


@dataclass
class CallResult:
    """One function's values on a run of samples, and what it asked TRL to log."""

    values: list[float | None]
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)


def call_user_function(fn: Callable[..., Any], style: str, name: str, inputs: RewardInputs,
                       start: int) -> CallResult:
    """`fn` (TRL or verl style) on `inputs`, the samples from index `start` of the step."""
    if style == TRL:
        return _call_trl(fn, name, inputs, start)
    assert style == VERL, style
    takes_extra = _takes(fn, "extra_info")
    values = []
    for i in range(len(inputs)):
        kwargs = {"data_source": inputs.data_sources[i], "solution_str": inputs.completion_texts[i],
                  "ground_truth": inputs.ground_truths[i]}
        if takes_extra:
            kwargs["extra_info"] = inputs.extra_infos[i]
        sample = inputs.named(start + i)
        raw = _guarded(lambda: _awaited(fn(**kwargs)), name, sample)
        if isinstance(raw, dict):
            if "score" not in raw:
                raise HandoffError(f"reward {name} returned a dict without 'score' for {sample} "
                                   f"(keys: {', '.join(map(str, raw))}): return a number or a "
                                   "dict with a 'score'")
            raw = raw["score"]
        values.append(checked_value(raw, name, sample))
    return CallResult(values)


def _call_trl(fn: Callable[..., Any], name: str, inputs: RewardInputs, start: int) -> CallResult:
    result = CallResult([])

    def log_extra(column: str, values: list) -> None:
        result.extra_columns.setdefault(column, []).extend(values)

    def log_metric(metric: str, value: float) -> None:
        result.metrics.setdefault(metric, []).append(float(value))

    kwargs = dict(inputs.columns, prompts=inputs.prompts, completions=inputs.completions,
                  completion_ids=inputs.completion_ids,
                  trainer_state=_trainer_state(inputs.step, inputs.max_steps),
                  log_extra=log_extra, log_metric=log_metric)
    where = inputs.named(start, start + len(inputs) - 1)
    raw = _guarded(lambda: _awaited(fn(**kwargs)), name, where)
    if isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__len__"):
        raise HandoffError(f"reward {name} returned {_show(raw)} ({type(raw).__name__}) for "
                           f"{where}, not a list: return one float (or None) per completion")
    if len(raw) != len(inputs):
        raise HandoffError(f"reward {name} returned {len(raw)} values for {len(inputs)} "
                           f"completions ({where}): return one float (or None) per completion")
    result.values = [checked_value(v, name, inputs.named(start + i)) for i, v in enumerate(raw)]
    return result


def call_builtin(grader: Callable[..., Any], name: str, problem: Any, text: str,
                 sample: str) -> tuple[float, bool, bool]:
    """(reward, correct, formatted) of a built-in grader on `sample` (named_samples)."""
    score = _guarded(lambda: grader(problem, text), name, sample,
                     fix="fix the data or pick another reward")
    return checked_value(score.reward, name, sample), bool(score.correct), bool(score.formatted)


# The advantages are float32 statistics of a group's rewards: their squared deviations must
# stay finite for any group size (sqrt(float32 max) is 1.8e19), hence a bound far below it.
REWARD_LIMIT = 1e15


def checked_value(value: Any, name: str, sample: str) -> float | None:
    """A reward as a float (None stays None: no reward); wrong types and non-finite refused,
    naming `sample` (named_samples)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not (
            isinstance(value, numbers.Real) or hasattr(type(value), "__float__")):
        raise HandoffError(f"reward {name} gave {_show(value)} ({type(value).__name__}) for "
                           f"{sample}: return a float, or None for no reward")
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):   # an int past float's range, a bad __float__
        raise HandoffError(f"reward {name} gave {_show(value)} for {sample}, which is not a "
                           "float (out of its range?): return a finite float, or None for no "
                           "reward") from None
    if not math.isfinite(number):
        raise HandoffError(f"reward {name} gave {number} for {sample}: return a finite float, "
                           "or None for no reward")
    check_reward_range(number, f"reward {name} gave {number:g} for {sample}")
    return number


def check_reward_range(value: float, what: str) -> None:
    """Refuse a reward the advantages' float32 statistics cannot hold (REWARD_LIMIT)."""
    if abs(value) > REWARD_LIMIT:
        raise HandoffError(f"{what}, past +-{REWARD_LIMIT:g}, where the advantages' float32 "
                           "statistics overflow: return a smaller finite float (scale it)")


def _guarded(call: Callable[[], Any], name: str, where: str, *,
             fix: str = "fix the function") -> Any:
    try:
        return call()
    except HandoffError:
        raise
    except SystemExit as e:   # sys.exit() in a reward ends no run silently
        raise HandoffError(f"reward {name} raised SystemExit({e.code!r}) on {where}: "
                           f"{fix}") from e
    except Exception as e:
        raise HandoffError(f"reward {name} raised {type(e).__name__} on {where}: "
                           f"{first_line(e)}: {fix}") from e


def _awaited(value: Any) -> Any:
    """An async reward's result (TRL awaits those too), run to completion here."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _takes(fn: Callable[..., Any], param: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return param in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _trainer_state(step: int, max_steps: int) -> Any:
    from transformers import TrainerState  # the type TRL passes; imported only when needed

    return TrainerState(global_step=step, max_steps=max_steps)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

