"""Checks of an HF checkpoint directory before anything loads it (no torch here).

    check_model_dir("ckpt/", flag="model.path")    # config.json, tokenizer, complete weights
    cap_context(cfg)                               # max_model_len within the model's positions
    check_loading_info("ckpt/", info)              # after transformers' from_pretrained

A weights file cut short (a copy that stopped, a full disk) or a config.json that does not
describe the weights should be one line naming the file, not a loader's traceback, and
never a model that trains from a random tensor: transformers fills a missing tensor with a
fresh init and carries on, so the trainer checks what it reports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from handoff.errors import HandoffError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit on its JSON header


def read_model_config(path: str | Path, *, flag: str = "--model") -> dict:
    """config.json of a checkpoint directory as a dict, or one line naming what is wrong."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HandoffError(f"{flag}={str(path)!r} is not an HF checkpoint directory (no "
                           "config.json): create one with `handoff init-model --preset "
                           "tiny-qwen3 --out DIR` or point it at a downloaded model")
    try:
        config = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HandoffError(f"{file} is not valid JSON ({e.__class__.__name__}): restore the "
                           "checkpoint's config.json") from None
    if not isinstance(config, dict):
        raise HandoffError(f"{file} is not a JSON object: restore the checkpoint's config.json")
    return config


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: its index's shards, or every *.safetensors."""
    model = Path(path)
    index = model / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_bytes())["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise HandoffError(f"{index} is not a safetensors index (truncated or edited): "
                               "restore it from the checkpoint") from None
        files = [model / name for name in shards]
        for f in files:
            if not f.is_file():
                raise HandoffError(f"{f} is missing (listed in {index.name}): copy the whole "
                                   "checkpoint")
        return files
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise HandoffError(f"{model} has no *.safetensors weights: handoff loads safetensors "
                           "checkpoints only (save with safe_serialization=True)")
    return files


def check_safetensors(file: Path) -> None:
    """Raise unless the file's header parses and its data is all there."""
    size = file.stat().st_size
    fix = "copy the checkpoint again (or re-create it with `handoff init-model`)"
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER_BYTES):
            raise HandoffError(f"{file} is truncated or not a safetensors file ({size} bytes, "
                               f"no complete header): {fix}")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items()
                       if k != "__metadata__"), default=0)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                AttributeError, IndexError):
            raise HandoffError(f"{file} has a damaged safetensors header: {fix}") from None
    if 8 + n + end > size:
        raise HandoffError(f"{file} is truncated: its header describes {8 + n + end} bytes, the "
                           f"file has {size}: {fix}")


def check_model_dir(path: str | Path, *, flag: str = "--model", tokenizer: bool = True) -> None:
    """config.json readable, the tokenizer's files present, every weights file complete."""
    read_model_config(path, flag=flag)
    model = Path(path)
    if tokenizer and not any((model / name).is_file() for name in TOKENIZER_FILES):
        raise HandoffError(f"{model} has no tokenizer files ({' or '.join(TOKENIZER_FILES)}): "
                           "save the tokenizer next to the weights "
                           "(tokenizer.save_pretrained(DIR))")
    for file in weight_files(model):
        check_safetensors(file)


def cap_context(cfg) -> None:
    """Lower rollout.max_model_len to the model's max_position_embeddings, with a warning
    (the engine would cap it anyway, silently); refuse a max_tokens that leaves no prompt."""
    ro = cfg.rollout
    positions = int(read_model_config(cfg.model.path, flag="model.path")
                    .get("max_position_embeddings", 4096))
    if ro.max_model_len > positions:
        if os.environ.get("RANK", "0") == "0":
            from rich.console import Console

            Console(stderr=True).print(
                f"[yellow]warning: rollout.max_model_len={ro.max_model_len} is above the "
                f"model's max_position_embeddings={positions}: capped at {positions}[/]",
                highlight=False)
        ro.max_model_len = positions
    if ro.max_tokens >= ro.max_model_len:
        raise HandoffError(f"rollout.max_tokens={ro.max_tokens} leaves no room for a prompt in "
                           f"the model's {ro.max_model_len} positions (max_position_embeddings): "
                           "lower rollout.max_tokens")


def check_loading_info(path: str | Path, info: dict) -> None:
    """Raise on a tensor transformers found with the wrong shape, or did not find at all."""
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        name, found, expected = mismatched[0]
        raise HandoffError(f"{path}: tensor {name} has shape {tuple(found)}, its config.json "
                           f"makes it {tuple(expected)} ({len(mismatched)} such tensor(s)): the "
                           "weights and config.json disagree; restore the checkpoint")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise HandoffError(f"{path} lacks tensor {missing[0]} ({len(missing)} missing): the "
                           "weights do not match config.json; restore the checkpoint")
