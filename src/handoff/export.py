"""`handoff export RUN_DIR --out DIR [--step N]`: a run's checkpoint as a Hugging Face model.

    path = export_model("runs/cpu-demo", "exported/", step=None, overwrite=False)
    AutoModelForCausalLM.from_pretrained("exported/")      # or: handoff generate --model exported/

What DIR gets: the trained weights as safetensors in the dtype the run trained them in (the
checkpoint's `model` part, not the fp32 master copy of the optimizer), sharded at 5 GB with
an index beyond that; a tied lm_head is left out, as transformers saves it (the config's
`tie_word_embeddings` ties it again at load); config.json, generation_config.json and the
tokenizer of the run's model (run_dir/config.json's model.path); handoff_export.json naming
the run, the checkpoint and its step.

The checkpoint is read as a resume reads it (trainer/checkpoint_files.py): every file against
meta.json's sha256 first, DCP's metadata through the allow-list, shards with weights_only.
Everything is written into DIR/.handoff-export.tmp and then moved into DIR, so nothing is
written outside DIR and an export cut short leaves no half model; DIR must not be a symbolic
link, and a DIR that holds files is refused without --overwrite (which replaces the files an
export writes and its earlier weight shards, and keeps the rest).

A LoRA run (actor.lora.rank > 0) checkpoints only its adapter (export_lora.py): --adapter
writes it as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors);
without it the adapter is merged into the base and written as above. --adapter on a run that
trained every parameter is refused. Every check runs before the first write.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from handoff.errors import HandoffError
from handoff.export_lora import (MergedWeights, adapter_config, check_adapter, run_lora,
                                 write_adapter)
from handoff.model_files import (check_model_dir, load_tokenizer, read_model_config,
                                 weight_files)
from handoff.model_source import resolve_model
from handoff.reading import read_json
from handoff.safe_files import usual_mode
from handoff.trainer.checkpoint import checkpoint_step, latest_checkpoint
from handoff.trainer.checkpoint_files import FORMAT, META, SafeReader, verify_files
from handoff.trainer.checkpoint_files import read_json as read_checkpoint_json

STAGING = ".handoff-export.tmp"
MAX_SHARD_BYTES = 5 * 10**9
INDEX = "model.safetensors.index.json"
_STEP_DIR = re.compile(r"step_(\d+)_[A-Za-z0-9]+")


def export_model(run_dir: str | Path, out: str | Path, *, step: int | None = None,
                 overwrite: bool = False, adapter: bool = False) -> Path:
    """Write the run's checkpoint (the latest, or the one of `step`) to `out` as an HF model
    directory (a LoRA run: merged; with `adapter`, its PEFT adapter directory); returns `out`."""
    run_dir, out = Path(run_dir), Path(out)
    _check_out(out, overwrite=overwrite)   # refused before a large checkpoint is read
    _check_apart(run_dir, out)
    run_config, run_file = _run_config(run_dir)
    model_dir = _run_model_dir(run_config, run_file)
    lora = run_lora(run_config, run_file)
    if adapter and lora is None:
        raise HandoffError(f"--adapter exports a LoRA adapter, but {run_dir} trained every "
                           "parameter (its config.json has no actor.lora.rank > 0): leave "
                           "--adapter out to export the full model")
    peft_config = adapter_config(lora, model_dir) if adapter else None   # needs peft
    ckpt = find_checkpoint(run_dir, step)
    config = read_model_config(model_dir, flag="the run's model.path")
    weights = CheckpointPart(ckpt, "model")
    if lora is None:
        _check_fits_model(weights.tensors, model_dir, config, ckpt)
    else:
        pairs = check_adapter(weights.tensors, model_dir, lora, ckpt)
        if not adapter:
            weights = MergedWeights(model_dir, weights, pairs, lora)
    dtype = next(iter(weights.tensors.values())).dtype   # every param in one dtype
    created = not out.exists()
    staging = _fresh_staging(out)
    try:
        if adapter:
            write_adapter(weights, pairs, peft_config, staging)
        else:
            _write_weights(weights, staging, tie=bool(config.get("tie_word_embeddings")))
            _write_config(model_dir, config, dtype, staging)
        (staging / "handoff_export.json").write_text(json.dumps(
            {"run_dir": str(run_dir.resolve()), "checkpoint": ckpt.name,
             "step": checkpoint_step(ckpt), "model": str(model_dir),
             "lora": None if lora is None else {**asdict(lora), "merged": not adapter}},
            indent=1))
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(out if created else staging, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------- reading the run


def _run_config(run_dir: Path) -> tuple[dict, Path]:
    """run_dir/config.json, the run's resolved config, and its path."""
    file = run_dir / "config.json"
    if not file.is_file():
        raise HandoffError(f"{run_dir} is not a handoff run directory (no config.json): pass "
                           "the run.out_dir of a `handoff train` run")
    return read_json(file), file


def _run_model_dir(run_config: dict, file: Path) -> str:
    """The model the run trained: its config.json's model.path, as a directory."""
    model = run_config.get("model")
    path = model.get("path") if isinstance(model, dict) else None
    if not isinstance(path, str):
        raise HandoffError(f"{file} does not record model.path (truncated or edited): "
                           "restore the run's config.json")
    model_dir = resolve_model(path, flag="the run's model.path")
    check_model_dir(model_dir, flag="the run's model.path")   # its config and tokenizer
    return model_dir


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint of `step` under run_dir/checkpoints (None: the latest)."""
    root = run_dir / "checkpoints"
    if step is None:
        latest = latest_checkpoint(root)
        if latest is None:
            raise HandoffError(f"{run_dir} has no complete checkpoint ({root}/latest is "
                               "missing): train with run.checkpoint=true until a step is saved")
        return latest
    if step < 0:
        raise HandoffError(f"--step {step} is negative: pass the step of a saved checkpoint")
    complete = [p for p in (sorted(root.iterdir()) if root.is_dir() else [])
                if _STEP_DIR.fullmatch(p.name) and not p.is_symlink() and (p / META).is_file()]
    found = [p for p in complete if int(_STEP_DIR.fullmatch(p.name).group(1)) == step]
    if not found:
        steps = sorted({int(_STEP_DIR.fullmatch(p.name).group(1)) for p in complete})
        raise HandoffError(f"{run_dir} has no complete checkpoint of step {step}: it keeps "
                           f"steps {steps or 'none'}; pass one of them to --step, or leave "
                           "--step out for the latest")
    return max(found, key=lambda p: (p / META).stat().st_mtime)   # a step saved again: newest


class CheckpointPart:
    """One part of a checkpoint ("model": the trained params), verified as a resume verifies
    it: every tensor's full shape and dtype at once (`tensors`: meta tensors, no memory),
    their values a group at a time (`load`), on one process whatever world size wrote it."""

    def __init__(self, ckpt: Path, part: str):
        meta = read_checkpoint_json(ckpt / META, "checkpoint's meta.json")
        if meta.get("format") != FORMAT:
            raise HandoffError(f"{ckpt} was written by an older handoff (format "
                               f"{meta.get('format', 1)}, without file hashes): it cannot be "
                               "verified; export it with the handoff that wrote it")
        verify_files(ckpt, meta.get("files"))
        self.reader = SafeReader(ckpt, meta["files"])
        self.reader.check()
        self.ckpt, self.part = ckpt, part
        prefix = f"{part}."
        self.tensors = {
            key.removeprefix(prefix): torch.empty(tuple(m.size), dtype=m.properties.dtype,
                                                  device="meta")
            for key, m in self.reader.read_metadata().state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
        if not self.tensors:
            raise HandoffError(f"{ckpt} holds no {part!r} tensors: it is not a checkpoint of "
                               "`handoff train`; export another step")

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """{name: full tensor on the host} for `names`."""
        state = {n: torch.empty_like(self.tensors[n], device="cpu") for n in names}
        with warnings.catch_warnings():   # one process by design, which DCP warns about
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({self.part: state}, storage_reader=self.reader, no_dist=True)
        return state


def _check_fits_model(tensors: dict[str, torch.Tensor], model_dir: str, config: dict,
                      ckpt: Path) -> None:
    """The checkpoint's tensors are the model directory's, name for name and shape for shape
    (config.json is copied from there, so a model.path edited since would mislabel them)."""
    from safetensors import safe_open

    shapes = {}
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            shapes |= {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    ours = {name: list(t.shape) for name, t in tensors.items()}
    for name in sorted(set(shapes) | set(ours)):
        if shapes.get(name) != ours.get(name):
            raise HandoffError(f"checkpoint {ckpt} does not fit the run's model {model_dir}: "
                               f"{name} is {ours.get(name, 'absent')} in the checkpoint, "
                               f"{shapes.get(name, 'absent')} in the model; point the run's "
                               "config.json model.path at the model it trained")


# ---------------------------------------------------------------- writing DIR


def _check_out(out: Path, *, overwrite: bool) -> None:
    """Refuse a link, a file or (without overwrite) a directory that holds files."""
    if out.is_symlink():
        raise HandoffError(f"--out {str(out)!r} is a symbolic link: export writes only into a "
                           "real directory; pass its target or a new path")
    if out.exists() and not out.is_dir():
        raise HandoffError(f"--out {str(out)!r} is a file, not a directory: pass a directory "
                           "(created if missing)")
    used = [p.name for p in out.iterdir() if p.name != STAGING] if out.is_dir() else []
    if used and not overwrite:
        raise HandoffError(f"--out {str(out)!r} already holds files ({', '.join(sorted(used)[:3])}"
                           f"{', ...' if len(used) > 3 else ''}): pass --overwrite to replace "
                           "them, or choose an empty directory")


def _check_apart(run_dir: Path, out: Path) -> None:
    """Refuse a DIR that is the run's directory or inside it, or that holds it: the export's
    config.json and weights would replace the run's own files (or a checkpoint being read)."""
    run, target = run_dir.resolve(), out.resolve()
    where = ("the run directory" if target == run else "inside the run directory"
             if run in target.parents else "a directory that holds the run" if target in
             run.parents else None)
    if where is not None:
        raise HandoffError(f"--out {str(out)!r} is {where} {str(run_dir)!r}: the export would "
                           "replace the run's files; pass a directory apart from it, e.g. "
                           "--out exported/")


def _fresh_staging(out: Path) -> Path:
    """An empty DIR/.handoff-export.tmp (a killed export's leftovers removed)."""
    staging = out / STAGING
    out.mkdir(parents=True, exist_ok=True)
    if staging.is_symlink() or staging.is_file():
        staging.unlink()
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _write_weights(weights: CheckpointPart, staging: Path, *, tie: bool) -> None:
    """safetensors shards of at most MAX_SHARD_BYTES (one file when it fits), with HF's index;
    one shard's tensors in host memory at a time."""
    from safetensors.torch import save_file

    names = sorted(weights.tensors)
    if tie:   # one storage for two names: transformers ties lm_head to the embedding at load
        names = [n for n in names if n != "lm_head.weight"]
    elif "lm_head.weight" not in names:
        raise HandoffError(f"checkpoint {weights.ckpt} has no lm_head.weight and the "
                           "model's config does not tie it to the embedding: export the run "
                           "with the model directory it trained")
    sizes = {n: weights.tensors[n].numel() * weights.tensors[n].element_size() for n in names}
    shards, size = [[]], 0
    for name in names:
        if shards[-1] and size + sizes[name] > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(files, shards):
        save_file(weights.load(shard), str(staging / file), metadata={"format": "pt"})
        usual_mode(staging / file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: file for file, shard in zip(files, shards) for n in shard}}
        (staging / INDEX).write_text(json.dumps(index, indent=1))


def _write_config(model_dir: str, config: dict, dtype: torch.dtype, staging: Path) -> None:
    """config.json (dtype set to the weights'), generation_config.json and the tokenizer."""
    from transformers import GenerationConfig

    config = dict(config)
    for key in ("dtype", "torch_dtype"):
        if key in config or key == "dtype":
            config[key] = str(dtype).removeprefix("torch.")
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    generation_file = Path(model_dir) / "generation_config.json"
    if generation_file.is_file():   # copied as data (the engine reads its eos ids)
        (staging / generation_file.name).write_text(json.dumps(read_json(generation_file),
                                                               indent=2))
    else:
        GenerationConfig(**{k: config[k] for k in ("bos_token_id", "eos_token_id",
                                                   "pad_token_id")
                            if config.get(k) is not None}).save_pretrained(staging)
    load_tokenizer(model_dir).save_pretrained(staging)


def _publish(staging: Path, out: Path) -> None:
    """Move the staged files into `out`; earlier weight shards go (a loader would read them)."""
    for old in out.iterdir():
        if not (old.name.endswith(".safetensors") or old.name == INDEX):
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    for new in sorted(staging.iterdir()):
        target = out / new.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(new, target)   # a link at target is replaced, never followed
    staging.rmdir()
