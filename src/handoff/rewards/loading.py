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
import os
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
    try:
        loader_spec.loader.exec_module(module)
        _check_shared_helpers()
    except Exception as e:
        del sys.modules[module_name]
        if isinstance(e, HandoffError):
            raise
        raise HandoffError(f"reward file {str(path)!r} raised {type(e).__name__} while "
                           f"loading ({first_line(e)}): fix the file") from e
    return module


_REWARD_FOLDERS: set[Path] = set()   # the folders of the reward files loaded in this process


def _check_shared_helpers() -> None:
    """Refuse a helper module that two reward files' folders both provide once Python has
    loaded one of them: it keeps one module per name, so a file beside the other would call
    this one's (`python FILE.py` would load the one beside it), silently. Checked after
    every load against every reward folder so far, so the order of reward.functions does
    not matter; a module loaded from elsewhere (an installed one) is left alone."""
    providers: dict[str, list[Path]] = {}
    for folder in sorted(_REWARD_FOLDERS):
        for name in _module_names(folder):
            providers.setdefault(name, []).append(folder)
    for name, folders in sorted(providers.items()):
        origin = _folder_of(sys.modules.get(name))
        if len(folders) > 1 and origin in folders:
            del sys.modules[name]   # a retry after the rename imports it afresh
            other = next(f for f in folders if f != origin)
            raise HandoffError(
                f"reward files' folders {str(origin)!r} and {str(other)!r} both have a module "
                f"named {name!r}, and Python keeps one module per name: a reward file in "
                f"{str(other)!r} would call the one in {str(origin)!r}. Rename one of them "
                "(a reward file loaded earlier in this process counts too: restart it)")


def _module_names(folder: Path) -> set[str]:
    """The top-level module names the files and packages in `folder` provide (an entry that
    cannot be read, e.g. another user's private folder, provides none)."""
    names = set()
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                stem, suffix = os.path.splitext(entry.name)
                try:
                    if suffix == ".py" and stem.isidentifier() and entry.is_file():
                        names.add(stem)
                    elif entry.name.isidentifier() and entry.is_dir() and os.path.isfile(
                            os.path.join(entry.path, "__init__.py")):
                        names.add(entry.name)
                except OSError:
                    continue
    except OSError:
        return set()
    return names


def _folder_of(module: Any) -> Path | None:
    """The folder a top-level module was loaded from (a package's: the one holding it)."""
    loaded = getattr(module, "__file__", None)
    if not isinstance(loaded, str):
        return None
    origin = Path(loaded).resolve()
    return origin.parent.parent if origin.name == "__init__.py" else origin.parent


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
