"""The config tree from YAML and `section.key=value` overrides, checked in one place.

    cfg = load_config("examples/cpu-demo.yaml", ["rollout.gpu_memory_utilization=0.8"])

`validate()` is the one place that checks every field against its declared range; its errors
name the field, the bad value and the accepted range. `reference()` lists every key for
`handoff config`. Imports no torch: `handoff plan` uses it on a laptop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from handoff.config.sections import Config
from handoff.errors import ConfigError
from handoff.lengths import ResponseLengths

T = TypeVar("T")
from handoff.reading import read_yaml


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


PATH_FIELDS = ("path", "eval_path", "out_dir", "rates_file")   # the keys' last parts


def _coerce(value: Any, tp: Any, key: str, meta: dict) -> Any:
    """Turn a YAML/CLI value into the field's declared type, or raise naming the field."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp = args[0]
    if typing.get_origin(tp) is list:
        return _coerce_list(value, typing.get_args(tp)[0], key, meta)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        use = "true, false or auto" if meta.get("auto") else "true or false"
        raise ConfigError(f"{key}={value!r} is not a boolean: use {use}")
    if tp is int:
        use = "a whole number such as 4" + (" or auto" if meta.get("auto") else "")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}={value!r} is not an integer: use {use}")
        if isinstance(value, int):   # exact: a float would round a seed above 2**53
            return value
        try:
            as_float = float(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not an integer: use {use}") from None
        if not math.isfinite(as_float):
            raise ConfigError(f"{key}={value!r} is not a finite number: pass a whole number in "
                              f"{_range_text(meta)} ({meta['help']})")
        if as_float != int(as_float):
            raise ConfigError(f"{key}={value!r} is not an integer: use {use}")
        return int(as_float)
    if tp is float:
        if isinstance(value, bool):   # float(True) is 1.0: kl_coef=true would train with 1.0
            raise ConfigError(f"{key}={value!r} is a boolean, not a number: use a value such as "
                              "0.5")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a number: use a value such as 0.5") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key}={value!r} is not a finite number: pass a value in "
                              f"{_range_text(meta)} ({meta['help']})")
        return number
    if tp is str:
        if value is None:
            raise ConfigError(f"{key} is empty (YAML null): give it a value")
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r} is not a string")
        text = str(value)
        # A shell expands ~ on a command line, YAML does not: out_dir: ~/runs made a
        # directory named "~" in the working directory.
        return os.path.expanduser(text) if key.rsplit(".", 1)[-1] in PATH_FIELDS else text
    return value


def _coerce_list(value: Any, item_tp: Any, key: str, meta: dict) -> list:
    """A list field from YAML or `key=[a,b]` (a single value is a list of one:
    run.loggers=wandb)."""
    if value is None:
        raise ConfigError(f"{key} is empty (YAML null): give a list such as [a, b] or []")
    items = value if isinstance(value, (list, tuple)) else [value]
    items = [_coerce(item, item_tp, f"{key}[{i}]", meta) for i, item in enumerate(items)]
    choices = meta.get("choices")
    if choices and set(items) <= set(choices):
        # A list of choices is a set: once each, in the choices' order (peft adapts the
        # model's modules in its own order, so [v_proj, q_proj] is [q_proj, v_proj]'s
        # adapter and must resume its checkpoint). An unknown item is left to validate.
        items = [c for c in choices if c in items]
    return items


def _apply(obj: Any, data: dict, prefix: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping of keys, got "
                          f"{data!r}")
    hints = _field_types(type(obj))
    metas = {f.name: dict(f.metadata) for f in dataclasses.fields(obj)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in metas:
            raise ConfigError(f"unknown config key {full!r}: known keys here are {sorted(metas)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, f"{full}.")
        elif metas[key].get("auto") and str(value).lower() == "auto":
            setattr(obj, key, "auto")
        else:
            setattr(obj, key, _coerce(value, hints[key], full, metas[key]))


def set_key(cfg: Config, dotted: str, raw: str) -> None:
    """Apply one `section.key=value` override; the value is parsed as YAML (1e-5, true, null)."""
    parts = dotted.split(".")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, ValueError, RecursionError):   # then the text as typed
        value = raw
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    _apply(cfg, nested, "")


def read_section(cls: type[T], data: Any, key: str) -> T:
    """One config section (`key` as a config file nests it, e.g. "actor.lora") from the
    mapping a config file or a run's config.json holds, refused as load_config refuses a bad
    value (ConfigError naming the key)."""
    section = cls()
    _apply(section, data, f"{key}.")
    validate(section, f"{key}.")
    return section


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply `key.sub=value` overrides, validate, return the tree."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            what = "is a directory, not a file" if p.is_dir() else "not found"
            raise ConfigError(f"config file {str(p)!r} {what}: pass the path of a YAML file "
                              "such as examples/cpu-demo.yaml")
        _apply(cfg, read_yaml(p) or {}, "")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value: write e.g. rollout.n=8")
        key, raw = item.split("=", 1)
        set_key(cfg, key.strip(), raw.strip())
    validate(cfg)
    return cfg


def _check_field(key: str, value: Any, meta: dict) -> None:
    if value is None or (meta.get("auto") and value == "auto"):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_field(f"{key}[{i}]", item, meta)
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}={value!r} is not accepted: choose one of {', '.join(map(str, choices))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # NaN compares false with every bound, so a range check alone would let it through.
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number: pass a value in "
                              f"{_range_text(meta)} ({meta['help']})")
        bad = ((meta.get("ge") is not None and value < meta["ge"])
               or (meta.get("gt") is not None and value <= meta["gt"])
               or (meta.get("le") is not None and value > meta["le"])
               or (meta.get("lt") is not None and value >= meta["lt"]))
        if bad:
            raise ConfigError(f"{key}={value} is out of range {_range_text(meta)}: pass a value "
                              f"inside it ({meta['help']})")


def _range_text(meta: dict) -> str:
    """A field's accepted range as an interval, e.g. (0, 1] or [1, inf)."""
    lo = ("[", meta["ge"]) if meta.get("ge") is not None else ("(", meta.get("gt"))
    hi = ("]", meta["le"]) if meta.get("le") is not None else (")", meta.get("lt"))
    return (f"{lo[0]}{lo[1] if lo[1] is not None else '-inf'}, "
            f"{hi[1] if hi[1] is not None else 'inf'}{hi[0]}")


def validate(cfg: Any, prefix: str = "") -> None:
    """Check every field against its declared range; raise ConfigError naming the first bad one."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            validate(value, f"{key}.")
        else:
            _check_field(key, value, dict(f.metadata))
    if prefix == "" and isinstance(cfg, Config):
        _check_cross_fields(cfg)


def _check_cross_fields(cfg: Config) -> None:
    if cfg.rollout.response_lengths is not None:
        try:
            ResponseLengths.parse(cfg.rollout.response_lengths)
        except ValueError as e:
            raise ConfigError(f"rollout.response_lengths: {e}") from None
    p = cfg.parallel
    if p.shard_size is not None and p.gpus % p.shard_size != 0:
        raise ConfigError(f"parallel.shard_size={p.shard_size} does not divide parallel.gpus={p.gpus}: "
                          "pick a divisor of the card count")
    if p.gpus % p.tp != 0:
        raise ConfigError(f"parallel.tp={p.tp} does not divide parallel.gpus={p.gpus}: "
                          "pick a divisor of the card count")
    ro = cfg.rollout
    if ro.max_tokens >= ro.max_model_len:
        raise ConfigError(f"rollout.max_tokens={ro.max_tokens} leaves no room for a prompt in "
                          f"rollout.max_model_len={ro.max_model_len}: lower max_tokens or raise "
                          "max_model_len above it")
    a = cfg.actor
    if a.lora.rank and not a.lora.target_modules:
        raise ConfigError(f"actor.lora.rank={a.lora.rank} with no actor.lora.target_modules: "
                          "name the projections to adapt (e.g. [q_proj, v_proj]) or set rank 0")
    optimizer_steps = cfg.run.steps * a.updates_per_step
    if a.warmup_steps > optimizer_steps:
        raise ConfigError(f"actor.warmup_steps={a.warmup_steps} is longer than the run's "
                          f"{optimizer_steps} optimizer steps (run.steps * actor.updates_per_step):"
                          " the learning rate would never reach actor.lr; lower warmup_steps")
    w = cfg.workload
    if w.max_response_len is not None and w.max_response_len < w.response_len:
        raise ConfigError(f"workload.max_response_len={w.max_response_len} (--max-response-len) "
                          f"is below the mean response length workload.response_len="
                          f"{w.response_len}: the longest response is at least the mean; raise "
                          "it or lower --response-len")
    run = cfg.run
    if not run.out_dir.strip():
        raise ConfigError("run.out_dir is empty (it would mean the current directory): name "
                          "a directory for the run's files, e.g. run.out_dir=runs/my-run")
    if run.resume and run.overwrite:
        raise ConfigError("run.resume and run.overwrite are both set: resume continues the run "
                          "in out_dir, overwrite replaces it; pick one")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dotted(tree: dict, prefix: str = "") -> dict:
    """A nested config dict as {"section.key": value} (leaves only)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def reference(cfg: Any = None, prefix: str = "") -> list[dict[str, str]]:
    """Every key of the config tree, in order: {"key", "default", "range", "help"} (the
    `handoff config` listing, generated from the fields' own metadata)."""
    cfg = Config() if cfg is None else cfg
    hints = _field_types(type(cfg))
    rows = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            rows += reference(value, f"{prefix}{f.name}.")
        else:
            meta = dict(f.metadata)
            bounded = any(meta.get(k) is not None for k in ("ge", "gt", "le", "lt"))
            # a boolean or 'auto' lists its three words (a plain boolean shows its default)
            words = ("true", "false") if meta.get("auto") and bool in typing.get_args(
                hints[f.name]) else meta.get("choices")
            accepted = (" | ".join(map(str, words)) if words
                        else _range_text(meta) if bounded else "")
            if meta.get("auto"):
                accepted += " | auto" if words else " or auto"
            rows.append({"key": f"{prefix}{f.name}", "default": json.dumps(value),
                         "range": accepted, "help": meta.get("help", "")})
    return rows
