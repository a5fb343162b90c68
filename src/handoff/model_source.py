"""What `model.path` (and `--model`) may name, resolved to a checkpoint directory in one place.

    resolve_model("runs/smollm2")             # a directory: returned as it is
    resolve_model("tiny-qwen3")               # a preset: random-init, written once to the cache
    resolve_model("smollm2-135m-instruct")    # the CPU demo's real model (demo_model.py)
    resolve_model("Qwen/Qwen3-0.6B")          # a Hub id: its snapshot in the local HF cache
    resolve_model("qwen3-32b", materialise_presets=False)   # `handoff plan`: shapes only

A preset of `handoff init-model` (plan/shapes.py's PRESETS) is a shape, not a trained model:
its weights are random (seed 0, bfloat16), written once to $HANDOFF_CACHE/<preset> (default
~/.cache/handoff) and reused; the resolution says so on stderr. A Hub id is looked up in the
local Hugging Face cache only ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/
hub) and never downloaded: when it is not there, one line names the download command.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from handoff.demo_model import SMOLLM2_PRESET, cache_root, convert_smollm2, default_dir
from handoff.errors import HandoffError, refuse_empty
from handoff.plan.shapes import PRESETS
from handoff.safe_files import cannot_write, usual_mode

PRESET_MARKER = "handoff_preset.json"   # written by modelzoo.init_model


def resolve_model(name: str, *, flag: str = "model.path", materialise_presets: bool = True) -> str:
    """A checkpoint directory for `name` (see the module docstring); anything that is none of
    the forms is returned unchanged, for the model directory's own checks to name."""
    refuse_empty(name, flag, "a model directory, a Hub id in your local cache or a preset name")
    if Path(name).exists():
        return name
    if name == SMOLLM2_PRESET:
        # The cache is handoff's own: a stale conversion there is written over.
        try:
            path = convert_smollm2(default_dir(), overwrite=True)
        except OSError as e:
            raise _cache_unwritable(e, flag) from None
        usual_mode(*Path(path).glob("*.safetensors"))
        return str(path)
    if name in PRESETS:
        return str(_preset_dir(name, flag)) if materialise_presets else name
    if _is_hub_id(name):
        return _cached_snapshot(name, flag)
    return name


def _is_hub_id(name: str) -> bool:
    """`org/name` as the Hub spells repository ids (a relative path like ./x/y is not one)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process reads, from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def _cached_snapshot(repo_id: str, flag: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:   # local_files_only: the network is never asked
        return snapshot_download(repo_id, local_files_only=True, cache_dir=cache)
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise HandoffError(f"{flag}={repo_id!r} is not a directory or a preset, and the Hub "
                           f"model {repo_id} is not in the local Hugging Face cache ({cache}): "
                           f"download it with `huggingface-cli download {repo_id}` (or `hf "
                           f"download {repo_id}`), or point {flag} at a checkpoint "
                           "directory") from None


def _preset_dir(preset: str, flag: str) -> Path:
    """The preset's random-init checkpoint in the handoff cache, written on first use."""
    from handoff.modelzoo import init_model

    out = cache_root() / preset
    print(f"{flag}={preset}: a preset shape with random weights (not a pretrained model), "
          f"cached in {out}", file=sys.stderr)
    if (out / PRESET_MARKER).is_file():
        return out
    # Written beside and renamed: a run killed mid-write never leaves a half model that
    # looks complete; a second process racing to the same preset keeps the first one's.
    tmp = out.with_name(f".{preset}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        init_model(preset, tmp, seed=0)
    except OSError as e:   # read-only or full: init_model removed what it made
        raise _cache_unwritable(e, flag) from None
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / PRESET_MARKER).is_file():
            raise HandoffError(f"{out} exists and is not a preset written by handoff: remove "
                               f"it, or set $HANDOFF_CACHE to another directory") from None
    return out


def _cache_unwritable(error: OSError, flag: str) -> HandoffError:
    """One line for a model handoff could not write to its cache, naming $HANDOFF_CACHE."""
    return cannot_write(f"the handoff cache {cache_root()} ($HANDOFF_CACHE)", error,
                        "set $HANDOFF_CACHE to a directory you can write to, or point "
                        f"{flag} at a checkpoint directory")
