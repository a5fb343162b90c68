"""The Python API, for a notebook or a script: the same run `handoff train` makes.

    import handoff
    summary = handoff.train("examples/cpu-demo.yaml", ["run.steps=4"],
                            reward_funcs=[my_reward])      # TRL or verl signature

`config` is a YAML path or a `handoff.config.Config`; `overrides` are `section.key=value`
strings; `reward_funcs` are called after those `reward.functions` names (reward.weights
covers both, in that order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from handoff.config import Config, load_config, set_key, validate
from handoff.errors import HandoffError
from handoff.loop import train as run_training
from handoff.model_source import resolve_model
from handoff.preflight import preflight


def train(config: str | Path | Config, overrides: Sequence[str] = (), *,
          reward_funcs: Sequence[Callable] = (), resume: bool = False,
          overwrite: bool = False) -> dict:
    """Check, then run `config` to the end; returns the summary (rank 0; {} elsewhere)."""
    if isinstance(overrides, (str, bytes)):   # it would be read a character at a time
        raise HandoffError(f"overrides={overrides!r} is a string: pass a list of "
                           f"section.key=value strings, e.g. [{overrides!r}]")
    flags = (["run.resume=true"] if resume else []) + (["run.overwrite=true"] if overwrite else [])
    if isinstance(config, Config):
        cfg = config
        for item in [*overrides, *flags]:
            key, _, value = item.partition("=")
            set_key(cfg, key.strip(), value)
        validate(cfg)
    else:
        cfg = load_config(config, [*overrides, *flags])
    cfg.model.path = resolve_model(cfg.model.path)   # a preset or a Hub id: its directory
    plan = preflight(cfg)
    return run_training(cfg, plan=plan, reward_funcs=reward_funcs)
