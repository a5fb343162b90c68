"""What to change when a plan does not fit: the smallest change that re-plans to one that fits.

    advice = find_fitting_plan(cfg, verdict_of)  # {"overrides", "flags", "mode"} or None
    advice = find_fitting_lora_plan(cfg, verdict_of)   # the same under LoRA
    advice_text(advice)                         # one clause for the verdict's fix

Advice is not a rule of thumb ("raise --util or --tp" on one card led to another refusal):
every candidate is planned (`verdict_of`: report.build_plan's verdict of a config, passed
in so this module needs no import of report's), and the first one whose verdict fits is the
answer. Candidates, least change first: the highest safe utilization of the same layout;
both offloads (and the ref's) on; another engine TP on the same cards; then more cards,
fewest first from the fewest whose shard holds the training state (any count within a node,
whole nodes beyond one, up to MAX_CARDS), each with the TP sizes that divide the cards and
suit the model's heads. No torch here.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterator

from handoff.config import Config, validate
from handoff.errors import ConfigError
from handoff.plan.hardware import hardware_profile
from handoff.plan.ledger import Dtypes
from handoff.plan.shapes import ModelShape, load_shape
from handoff.plan.verdict import min_training_cards, tp_layout_problems

MAX_CARDS = 1024
_FLAGS = {"parallel.gpus": "--gpus", "parallel.tp": "--tp",
          "rollout.gpu_memory_utilization": "--util", "memory.param_offload": "--param-offload",
          "memory.optimizer_offload": "--optimizer-offload",
          "memory.ref_offload": "--ref-offload"}


def _tp_sizes(gpus: int, shape: ModelShape, near: int) -> list[int]:
    """Engine TP sizes that divide the cards and suit the heads, closest to `near` first."""
    sizes = [tp for tp in range(1, gpus + 1)
             if gpus % tp == 0 and not tp_layout_problems(shape, tp)]
    return sorted(sizes, key=lambda tp: (abs(math.log2(tp / near)), tp))


def _layouts(cfg: Config, shape: ModelShape) -> Iterator[tuple[int, int, int | None, bool]]:
    """(cards, engine TP, shard size, offloads on) to try, least change first."""
    p, m = cfg.parallel, cfg.memory
    all_on = m.param_offload and m.optimizer_offload and m.ref_offload
    offloads = [False] if all_on else [False, True]
    yield from ((p.gpus, p.tp, p.shard_size, on) for on in offloads)
    for tp in _tp_sizes(p.gpus, shape, p.tp):
        if tp != p.tp:
            yield from ((p.gpus, tp, p.shard_size, on) for on in offloads)
    for gpus in _more_cards(cfg, shape):
        for tp in _tp_sizes(gpus, shape, p.tp):
            yield from ((gpus, tp, None, on) for on in offloads)


def _more_cards(cfg: Config, shape: ModelShape) -> Iterator[int]:
    """Card counts above the config's, fewest first, from the fewest whose FSDP shard holds
    the training state: any count within a node, whole nodes beyond one."""
    hw = hardware_profile(cfg.hardware.name, cfg.hardware)
    fewest = min_training_cards(shape, Dtypes.for_model(cfg.model.dtype, cfg.rollout.kv_dtype),
                                hw)
    if fewest == 0:
        return   # no card count holds the trainer's activations: more cards cannot help
    for gpus in range(max(cfg.parallel.gpus + 1, fewest), MAX_CARDS + 1):
        if gpus <= hw.gpus_per_node or gpus % hw.gpus_per_node == 0:
            yield gpus


def _overrides(before: Config, after: Config) -> dict[str, object]:
    changed = {}
    for section in ("parallel", "memory", "rollout"):
        old, new = getattr(before, section), getattr(after, section)
        for key, value in vars(new).items():
            if getattr(old, key) != value:
                changed[f"{section}.{key}"] = value
    return changed


def _advice(before: Config, after: Config, mode: str) -> dict:
    changed = _overrides(before, after)
    if "parallel.gpus" in changed and "parallel.tp" not in changed:
        # Named even when unchanged: without --tp, `handoff plan` picks one for the new cards.
        changed = {"parallel.gpus": changed.pop("parallel.gpus"),
                   "parallel.tp": after.parallel.tp, **changed}
    overrides = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in changed.items()]
    flags = []
    for key, value in changed.items():
        if key in _FLAGS and isinstance(value, bool):
            flags.append(_FLAGS[key] if value else f"--no-{_FLAGS[key][2:]}")
        elif key in _FLAGS:
            flags.append(f"{_FLAGS[key]} {value}")
        else:   # no flag sets it back to the default (shard_size=null): an override
            flags.append(f"{key}={'null' if value is None else value}")
    return {"overrides": overrides, "flags": " ".join(flags), "mode": mode}


def find_fitting_plan(cfg: Config, verdict_of: Callable[[Config], dict]) -> dict | None:
    """The least change of `cfg` whose plan fits, re-planned to check it; None when none does."""
    shape = load_shape(cfg.model.path)
    for gpus, tp, shard, offload in _layouts(cfg, shape):
        trial = copy.deepcopy(cfg)
        trial.parallel.gpus, trial.parallel.tp, trial.parallel.shard_size = gpus, tp, shard
        if offload:
            trial.memory.param_offload = trial.memory.optimizer_offload = True
            trial.memory.ref_offload = True
        advice = _advice_if_fits(cfg, trial, verdict_of)
        if advice:
            return advice
    return None


def find_fitting_lora_plan(cfg: Config, verdict_of: Callable[[Config], dict]) -> dict | None:
    """LoRA's least change that fits (actor.lora.rank > 0): the engine at TP 1 (the base whole
    on each card), then the adapters' optimizer state offloaded too. More cards never help:
    every card holds the whole base."""
    for offload in sorted({cfg.memory.optimizer_offload, True}):
        trial = copy.deepcopy(cfg)
        trial.parallel.tp, trial.memory.optimizer_offload = 1, offload
        advice = _advice_if_fits(cfg, trial, verdict_of)
        if advice:
            return advice
    return None


def _advice_if_fits(cfg: Config, trial: Config, verdict_of: Callable[[Config], dict]
                    ) -> dict | None:
    """The advice of `trial` if it fits as requested or at its highest safe utilization."""
    for attempt in range(2):
        try:
            validate(trial)
        except ConfigError:
            return None
        verdict = verdict_of(trial)
        if verdict["fits"]:
            return _advice(cfg, trial, verdict["mode"])
        best = verdict["max_utilization"]
        if attempt or not best or best <= 0 or best == trial.rollout.gpu_memory_utilization:
            return None
        trial.rollout.gpu_memory_utilization = best
    return None


def advice_text(advice: dict | None) -> str:
    """The verdict's fix clause: a change that re-plans to a fit, or that none was found."""
    if advice is None:
        return (f"no plan fits on up to {MAX_CARDS} cards, with any engine TP, the offloads "
                "and the highest safe utilization: this model needs larger cards")
    return (f"it fits with {advice['flags']} (in a run config: {' '.join(advice['overrides'])}; "
            f"re-planned: mode {advice['mode']})")


# The offload sets a colocated run chooses from: (param, optimizer, ref) offloaded.
OFFLOAD_SETS = {"none": (False, False, False), "ref": (False, False, True),
                "params+ref": (True, False, True), "all": (True, True, True)}


def offload_options(cfg: Config, plan_of: Callable[[Config], dict]) -> dict:
    """Every offload set priced at the highest safe utilization it allows, and the fastest.

    More offloads buy a larger KV pool (a faster generation when the pool limits it) and
    cost switch time (its exposed seconds: with memory.overlap some copies hide behind
    work); the trainer's compute is the same for every set. `plan_of` is
    report.build_plan of a config (without advice). Returns {"sets": [{offloads, fits,
    utilization, kv_pool_bytes, generation_seconds, switch_seconds, step_seconds}],
    "recommended": the name of the fastest set that fits, or None}."""
    sets = []
    for name, (params, optimizer, ref) in OFFLOAD_SETS.items():
        trial = copy.deepcopy(cfg)
        trial.memory.param_offload, trial.memory.optimizer_offload = params, optimizer
        trial.memory.ref_offload = ref
        safe = plan_of(trial)["verdict"]["max_utilization"]
        entry = {"offloads": name, "fits": False, "utilization": safe}
        if safe and safe > 0:
            trial.rollout.gpu_memory_utilization = safe
            plan = plan_of(trial)
            row = next(r for r in plan["kv"] if r["requested"])
            step = plan["step"]
            entry.update(fits=plan["verdict"]["fits"] and row["generation_seconds"] is not None,
                         kv_pool_bytes=row["kv_pool_bytes"],
                         generation_seconds=row["generation_seconds"],
                         switch_seconds=step["switch_seconds"],
                         step_seconds=((row["generation_seconds"] or 0.0)
                                       + step["switch_seconds"] + step["train_seconds"]))
        sets.append(entry)
    fitting = [s for s in sets if s["fits"]]
    best = min(fitting, key=lambda s: s["step_seconds"]) if fitting else None
    return {"sets": sets, "recommended": best["offloads"] if best else None}
