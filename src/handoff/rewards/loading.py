"""Reward functions named in a config (`reward.functions`) or passed from Python, loaded once.

A spec is one of

* `FILE.py:NAME`: NAME from a Python file; a relative path is read from the current
  directory (as `data.path` is, and as verl reads `custom_reward_function.path`);
* `module.path:NAME`: NAME from an importable module (`my_rewards.math:accuracy`);
* `handoff:task | handoff:numeric | handoff:exact`: a built-in grader (builtin.py).

Loading a file or a module runs its code: it is the user's own code, trusted as verl and
TRL trust it (docs/BAD_INPUTS.md). What cannot be loaded is one HandoffError line naming
the spec and the fix.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from handoff.errors import HandoffError

TRL, VERL, BUILTIN = "trl", "verl", "builtin"
BUILTIN_PREFIX = "handoff:"


@dataclass(frozen=True)
class RewardFunction:
    """One reward: what it is called in the metrics, how to call it, how to load it again."""

    name: str  # the metrics key is reward/<name>
    fn: Callable[..., Any]
    style: str  # TRL (by keyword, a batch), VERL (per sample), BUILTIN (problem, text)
    spec: str | None  # how a pool worker loads it again; None: passed from Python


def callable_name(fn: Callable[..., Any]) -> str:
    """The name TRL logs a function under: a partial's inner name, else __name__ or the class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def style_of(fn: Callable[..., Any]) -> str:
    """VERL when a parameter is named `solution_str` (verl's compute_score), else TRL."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: TRL's keyword call
        return TRL
    return VERL if "solution_str" in params else TRL


def from_callable(fn: Callable[..., Any]) -> RewardFunction:
    """A function or callable object passed from Python (`handoff.train(reward_funcs=...)`)."""
    if not callable(fn):
        raise HandoffError(f"reward function {fn!r} is a {type(fn).__name__}, not callable: "
                           "pass functions or callable objects")
    return RewardFunction(callable_name(fn), fn, style_of(fn), spec=None)


def from_spec(spec: str) -> RewardFunction:
    """A user function named `FILE.py:NAME` or `module.path:NAME` (built-ins: builtin.py)."""
    fn = resolve_spec(spec)
    return RewardFunction(spec.rpartition(":")[2], fn, style_of(fn), spec=spec)


def split_spec(spec: str) -> tuple[str, str]:
    """(where, NAME) of a spec; one line naming the three forms when it is none of them."""
    where, sep, name = str(spec).strip().rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise HandoffError(f"reward spec {spec!r} is not FILE.py:NAME, module.path:NAME or "
                           "handoff:NAME: write e.g. reward.functions=[rewards.py:accuracy]")
    return where, name


@functools.cache
def resolve_spec(spec: str) -> Callable[..., Any]:
    """The callable a user spec names, loaded once per process (a pool worker loads its own)."""
    where, name = split_spec(spec)
    module = _load_file(where) if where.endswith(".py") else _import_module(where, spec)
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_"))
        raise HandoffError(f"reward spec {spec!r}: {where} has no {name!r} (its callables: "
                           f"{', '.join(found) or 'none'}): fix the name after the colon")
    fn = getattr(module, name)
    if not callable(fn):
        raise HandoffError(f"reward spec {spec!r}: {name} is a {type(fn).__name__}, not a "
                           "function: name a function or a callable object")
    return fn


def _load_file(where: str) -> Any:
    path = Path(where).expanduser()
    if not path.is_file():
        raise HandoffError(f"reward file {where!r} not found (a relative path is read from the "
                           f"current directory, {Path.cwd()}): fix the path in reward.functions")
    path = path.resolve()
    # A module name of its own per file, so two rewards.py in two folders do not collide.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"handoff_reward_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    # Its folder on the import path, as `python FILE.py` puts it, so `from helpers import x`
    # beside it loads (now and in a reward function's own later imports); at the end, so a
    # file there never shadows a module the trainer imports.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    _REWARD_FOLDERS.add(path.parent)
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up here
    # Python keeps one module per name: a helper.py beside this file would silently be the
    # helper.py of another reward file's folder loaded before it (or found first on the path).
    # Those already loaded step aside while the file loads, so its imports are seen afresh.
    siblings = _sibling_names(path.parent)
    aside = {name: sys.modules.pop(name) for name in siblings
             if _reward_folder_of(sys.modules.get(name)) not in (None, path.parent)}
    try:
        loader_spec.loader.exec_module(module)
        _check_siblings(path, siblings, aside)
    except Exception as e:
        del sys.modules[module_name]
        for name in aside:
            sys.modules.pop(name, None)
        sys.modules.update(aside)
        if isinstance(e, HandoffError):
            raise
        raise HandoffError(f"reward file {str(path)!r} raised {type(e).__name__} while "
                           f"loading ({first_line(e)}): fix the file") from e
    for name, earlier in aside.items():
        sys.modules.setdefault(name, earlier)   # not imported by this file: as it was
    return module


_REWARD_FOLDERS: set[Path] = set()   # the folders of the reward files loaded in this process


def _sibling_names(folder: Path) -> set[str]:
    """The top-level module names the files and packages in `folder` provide."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return set()
    return ({p.stem for p in entries if p.suffix == ".py" and p.stem.isidentifier()}
            | {p.name for p in entries if (p / "__init__.py").is_file()})


def _reward_folder_of(module: Any) -> Path | None:
    """The reward file's folder a top-level module was loaded from (None: loaded elsewhere)."""
    loaded = getattr(module, "__file__", None)
    if loaded is None:
        return None
    origin = Path(loaded).resolve()
    folder = origin.parent.parent if origin.name == "__init__.py" else origin.parent
    return folder if folder in _REWARD_FOLDERS else None


def _check_siblings(path: Path, siblings: set[str], aside: dict[str, Any]) -> None:
    """Refuse a module this file imports by a name its own folder provides when Python
    loaded it from another reward file's folder (`python FILE.py` loads the one beside it),
    or when another reward file imported one of that name from its own folder."""
    for name in sorted(siblings):
        folder = _reward_folder_of(sys.modules.get(name))
        if folder is None:
            continue
        other = folder if folder != path.parent else _reward_folder_of(aside.get(name))
        if other is not None:
            raise HandoffError(
                f"reward file {str(path)!r} imports {name!r}, and another reward file's folder "
                f"{str(other)!r} has a module of that name too (Python keeps one module per "
                f"name, so one file would call the other's): rename the {name} beside one "
                "of them")


def _import_module(where: str, spec: str) -> Any:
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise HandoffError(f"reward spec {spec!r}: module {where!r} cannot be imported "
                           f"({first_line(e)}): install it, add its folder to PYTHONPATH, or "
                           "name a file (FILE.py:NAME)") from e
    except Exception as e:
        raise HandoffError(f"reward spec {spec!r}: importing {where!r} raised "
                           f"{type(e).__name__} ({first_line(e)}): fix the module") from e


def first_line(e: BaseException) -> str:
    """An exception's message in one line (its first), for a one-line HandoffError."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
