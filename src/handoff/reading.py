"""Reading a file someone else may have written: JSON, a JSON line, YAML, each bounded.

    config = read_json(model / "config.json")                     # {} ... or one line
    vocab = expect(config, "vocab_size", int, source=file)        # the field, of that type
    row = parse_json(line, source=f"{path} line {n}")
    data = read_yaml("run.yaml")                                   # aliases and size bounded

Every file a run or `handoff report` reads from a model directory, an out_dir or the user
goes through here, so a malformed, huge, deeply nested, non-finite or wrongly typed file is
one HandoffError naming the file (and the field), never a traceback, a hang or a NaN that
surfaces at step 1. Only data is parsed: nothing read can run code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from handoff.errors import ConfigError, HandoffError

MAX_JSON_BYTES = 64 << 20    # a tokenizer.json of a 250k vocabulary is ~20 MB
MAX_YAML_BYTES = 1 << 20     # a config of a few hundred keys is a few kB
MAX_DEPTH = 64               # no file we read nests deeper than ~6
MAX_NODES = 4_000_000        # values in one file (a large tokenizer.json holds ~1M)
MAX_YAML_ALIASES = 100       # each alias may repeat a whole subtree: bounded before expansion


def _non_finite(text: str) -> float:
    raise ValueError(f"{text} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):   # 1e999 parses to inf
        raise ValueError(f"{text} is not a finite number")
    return value


def _parse(text: str | bytes, source: str) -> Any:
    import json

    try:
        return json.loads(text, parse_constant=_non_finite, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise HandoffError(f"{source} is not valid JSON ({e.msg} at line {e.lineno}): restore "
                           "or fix the file") from None
    except UnicodeDecodeError:
        raise HandoffError(f"{source} is not UTF-8 text: restore or fix the file") from None
    except RecursionError:
        raise HandoffError(f"{source} nests deeper than {MAX_DEPTH} levels: restore or fix "
                           "the file") from None
    except ValueError as e:   # a non-finite number, or an integer of thousands of digits
        raise HandoffError(f"{source} holds a number that is not usable ({e}): restore or fix "
                           "the file") from None


def check_tree(value: Any, source: str, *, finite: bool = True, max_depth: int = MAX_DEPTH,
               max_nodes: int = MAX_NODES) -> None:
    """Raise naming the first field past `max_depth`, the `max_nodes`-th value, or (with
    `finite`) a NaN or infinite float. Shared subtrees count each time they are reached, so
    a structure that would expand past the cap is refused without being expanded."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    nodes = 0
    while stack:
        item, path, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise HandoffError(f"{source} holds more than {max_nodes} values: it is not a file "
                               "handoff writes or reads; restore or fix it")
        if depth > max_depth:
            raise HandoffError(f"{source}: field {path} nests deeper than {max_depth} levels: "
                               "restore or fix the file")
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k), depth + 1)
                         for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(item))
        elif finite and isinstance(item, float) and not math.isfinite(item):
            raise HandoffError(f"{source}: field {path} is {item}, not a finite number: restore "
                               "or fix the file")


def _read_bytes(path: Path, max_bytes: int, what: str) -> bytes:
    if not path.is_file():
        raise HandoffError(f"{what} {str(path)!r} is not a file: pass an existing file")
    size = path.stat().st_size
    if size > max_bytes:
        raise HandoffError(f"{what} {str(path)!r} is {size / 1e6:.1f} MB, more than the "
                           f"{max_bytes / 1e6:.0f} MB such a file can be: pass the right file")
    with open(path, "rb") as f:
        return f.read(max_bytes + 1)


def parse_json(text: str | bytes, *, source: str) -> Any:
    """One JSON document (a file's text, a line of a .jsonl) checked like `read_json`."""
    value = _parse(text, source)
    check_tree(value, source)
    return value


def read_json(path: str | Path, *, max_bytes: int = MAX_JSON_BYTES,
              kind: type | None = dict) -> Any:
    """A JSON file: at most `max_bytes`, finite numbers, nesting within MAX_DEPTH, and of
    type `kind` at the top (None: any)."""
    path = Path(path)
    data = _read_bytes(path, max_bytes, "file")
    if len(data) > max_bytes:   # grew while we read it
        raise HandoffError(f"{path} grew past {max_bytes / 1e6:.0f} MB while being read")
    value = parse_json(data, source=str(path))
    if kind is not None and not isinstance(value, kind):
        raise HandoffError(f"{path} holds a JSON {type(value).__name__}, not a "
                           f"{_json_name(kind)}: restore or fix the file")
    return value


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader (plain data only) counting aliases as it composes."""

    def compose_node(self, parent, index):  # noqa: ANN001 (PyYAML's signature)
        if self.check_event(yaml.AliasEvent):
            self.aliases = getattr(self, "aliases", 0) + 1
            if self.aliases > MAX_YAML_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_YAML_ALIASES} aliases (*name): a config "
                                     "needs few, an alias bomb many")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001 (PyYAML's signature)
        # PyYAML keeps the last of two equal keys: a typo'd second `lr:` would win unseen.
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":   # `<<: *base` may override keys
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in lines:
                raise yaml.YAMLError(f"key {key!r} appears twice, lines {lines[key]} and "
                                     f"{line}: keep one")
            lines[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path, *, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """A YAML config as plain data: size, aliases, nesting and values bounded (ConfigError
    naming the file); NaN and infinity are left for the config, which names the field
    with its accepted range."""
    try:
        return _load_yaml(Path(path), max_bytes)
    except HandoffError as e:
        raise ConfigError(str(e)) from None


def _load_yaml(path: Path, max_bytes: int) -> Any:
    where = f"config file {str(path)!r}"
    data = _read_bytes(path, max_bytes, "config file")
    try:
        value = yaml.load(data.decode("utf-8"), Loader=_BoundedLoader)  # noqa: S506 (safe loader)
    except UnicodeDecodeError:
        raise HandoffError(f"{where} is not UTF-8 text: save it as UTF-8") from None
    except RecursionError:
        raise HandoffError(f"{where} nests deeper than Python can parse: fix the file") from None
    except ValueError as e:   # an integer of thousands of digits
        raise HandoffError(f"{where} holds a value that is not usable ({e}): fix it") from None
    except yaml.YAMLError as e:
        said = " ".join(str(e).split())   # PyYAML's message spans lines
        raise HandoffError(f"{where} is not valid YAML ({said}): fix the syntax") from None
    check_tree(value, where, finite=False, max_nodes=100_000)
    return value


def expect(data: dict, key: str, kind: type | tuple[type, ...], *, source: str,
           default: Any = ..., lo: float | None = None) -> Any:
    """data[key] if it is of `kind` (bool is not an int here) and at least `lo`; `default`
    when absent (or JSON null) and a default is given; else one line naming file and field."""
    value = data.get(key)
    if value is None:
        if default is not ...:
            return default
        raise HandoffError(f"{source} lacks the field {key!r}: restore or fix the file")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join(_json_name(k) for k in kinds)
        raise HandoffError(f"{source}: field {key!r} is {value!r}, not a {names}: restore or "
                           "fix the file")
    if lo is not None and value < lo:
        raise HandoffError(f"{source}: field {key!r} is {value!r}, below {lo}: restore or fix "
                           "the file")
    return value


def _json_name(kind: type) -> str:
    return {dict: "JSON object", list: "JSON list", str: "string", int: "whole number",
            float: "number", bool: "true/false"}.get(kind, kind.__name__)
