"""The persistent compile cache: torch.compile's work kept across processes in handoff's cache.

    compile_cache.activate()                 # before the first compile (trainer/compiled.py)
    compile_cache.switched_off()             # HANDOFF_COMPILE_CACHE=0
    key = compile_cache.layer_key(shape, "bfloat16")
    compile_cache.is_warm(key)               # the plan prices a warm start (plan/compile.py)
    compile_cache.mark_warm(key)             # after a step that compiled (loop.py)

Inductor's FX graph cache and AOTAutograd's cache (both on by default in torch) and the Triton
kernels they build live under TORCHINDUCTOR_CACHE_DIR, read by torch at each use; activate()
points it at $HANDOFF_CACHE/compile (default ~/.cache/handoff/compile) in this process and
the ones it starts, so a second run of the same layer shape loads the compiled graphs instead
of generating and building them again. One environment variable, no artefacts saved or
loaded by hand (Mega-Cache's save/load is for moving a cache between machines; tested here on
torch 2.13, whose variable torch 2.11 reads alike). Nothing is read from a run's out_dir
or a model directory. (One exception is torch's: a CPU build keeps its C++ precompiled headers
in torch's default directory whatever the variable says; CUDA's Triton kernels follow it.)

Off switch: HANDOFF_COMPILE_CACHE=0. Then torch keeps its own default (a per-user temporary
directory, /tmp/torchinductor_$USER) and handoff writes nothing under its cache. A
TORCHINDUCTOR_CACHE_DIR the user set is theirs: left as it is, and no warm marks are written.

A warm mark ($HANDOFF_CACHE/compile/handoff-warm/<key>, an empty file) says that a run of this
torch compiled this layer shape into the cache: what the planner prices as a warm start.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

from handoff.demo_model import cache_root
from handoff.plan.shapes import ModelShape

OFF_SWITCH = "HANDOFF_COMPILE_CACHE"
TORCH_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
_WARM = "handoff-warm"
_active = False   # this process directed torch's caches to cache_dir() (activate)


def cache_dir() -> Path:
    """Where handoff keeps torch.compile's caches."""
    return cache_root() / "compile"


def switched_off() -> bool:
    return os.environ.get(OFF_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")


def activate() -> bool:
    """Point torch's compile caches at cache_dir() before the first compile; False (torch's
    choice kept) when switched off, when the user set TORCHINDUCTOR_CACHE_DIR to a directory
    of their own, or when ours cannot be made. Torch writes its default into the variable
    when inductor is imported, so only a value other than that default is the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    global _active
    if switched_off():
        return False
    where, given = cache_dir(), os.environ.get(TORCH_CACHE_VAR)
    if given is not None and Path(given) not in (where, Path(default_cache_dir())):
        return False
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    os.environ[TORCH_CACHE_VAR] = str(where)
    _active = True
    return True


def layer_key(shape: ModelShape, dtype: str) -> str:
    """A decoder layer's compile identity: its type, widths and dtype, and torch's version."""
    fields = (shape.model_type or "model", f"h{shape.hidden_size}",
              f"i{shape.intermediate_size}", f"q{shape.num_heads}", f"kv{shape.num_kv_heads}",
              f"d{shape.head_dim}", dtype, f"torch{_torch_version()}")
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", "-".join(fields))


def _torch_version() -> str:
    """torch's version from its package metadata (torch itself not imported: the planner
    runs without it); 'unknown' where the metadata cannot be read (a process whose user
    cannot read site-packages): marks then match within that environment only."""
    try:
        return importlib.metadata.version("torch")
    except (importlib.metadata.PackageNotFoundError, OSError):
        return "unknown"


def is_warm(key: str) -> bool:
    """A run of this layer shape compiled into the persistent cache before (and it is on);
    a cache this process cannot read is not warm."""
    try:
        return not switched_off() and (cache_dir() / _WARM / key).is_file()
    except OSError:
        return False


def mark_warm(key: str) -> None:
    """Remember that `key` is compiled in the cache; a cache that cannot be written is only
    priced cold next time, never an error. Only where this process compiled into it."""
    if not _active:
        return
    marks = cache_dir() / _WARM
    try:
        marks.mkdir(parents=True, exist_ok=True)
        (marks / key).touch()
    except OSError:
        pass
