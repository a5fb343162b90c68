"""`handoff export RUN_DIR --out DIR [--step N]`: a run's checkpoint as a Hugging Face model.

    path = export_model("runs/cpu-demo", "exported/", step=None, overwrite=False)
    export_model("runs/old", "exported/", model="models/qwen3")   # an older run's relative path
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

The model is the run's model.path: an absolute directory, a preset or a Hub id in the local
cache. A relative directory (an older run's, relative to where that run started) is never
looked up in the current directory: export refuses it and `--model DIR` names the model
instead, checked against the checkpoint as the run's is. A checkpoint that a live run prunes
while export reads it, or one that cannot be read, is named in one line with the steps kept
(--step N of another); an --out that cannot be written (read-only, a full disk, a file on
its path) is one line, and what the export made is removed.

A LoRA run (actor.lora.rank > 0) checkpoints only its adapter (export_lora.py): --adapter
writes it as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors);
without it the adapter is merged into the base and written as above. --adapter on a run that
trained every parameter is refused. Every check runs before the first write.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from handoff.demo_model import SMOLLM2_PRESET
from handoff.errors import HandoffError, refuse_empty
from handoff.export_lora import (MergedWeights, adapter_config, check_adapter, run_lora,
                                 save_tensors, write_adapter)
from handoff.model_files import (WEIGHTS_INDEX, check_model_dir, load_tokenizer,
                                 read_model_config, refuse_a_run, weight_files)
from handoff.model_source import _is_hub_id, resolve_model
from handoff.plan.shapes import PRESETS
from handoff.reading import read_json
from handoff.safe_files import first_missing, publish, usual_mode
from handoff.trainer.checkpoint import (CHECKPOINT_NAME, LATEST, checkpoint_step,
                                      complete_checkpoints, latest_checkpoint,
                                      saved_step)
from handoff.trainer.checkpoint_files import FORMAT, META, SafeReader, verify_files
from handoff.trainer.checkpoint_files import read_json as read_checkpoint_json
from handoff.units import fmt_bytes

STAGING = ".handoff-export.tmp"
EXPORT_RECORD = "handoff_export.json"   # what an export wrote, and from which run
MAX_SHARD_BYTES = 5 * 10**9
# The fix checkpoint_files.py gives a resume ("point `latest` at another checkpoint", "start
# over with --overwrite", "do not resume it"): an export's is --step N of another checkpoint.
_RESUME_FIX = re.compile(r"[;:] (?:point `latest`|start over|do not resume)")
_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def export_model(run_dir: str | Path, out: str | Path, *, step: int | None = None,
                 overwrite: bool = False, adapter: bool = False,
                 model: str | None = None) -> Path:
    """Write the run's checkpoint (the latest, or the one of `step`) to `out` as an HF model
    directory (a LoRA run: merged; with `adapter`, its PEFT adapter directory); returns `out`.
    `model`: the model directory the run trained, instead of its config.json's model.path."""
    refuse_empty(run_dir, "the run directory", "the run's out_dir (handoff export RUN --out DIR)")
    refuse_empty(out, "--out", "a directory to write the model to")
    run_dir, out = Path(run_dir), Path(out)
    _check_apart(run_dir, out, "the run directory", "replace the run's files")
    run_config, run_file = _run_config(run_dir)
    model_dir, flag = _run_model_dir(run_config, run_file, model)
    _check_apart(Path(model_dir), out, "the model directory the run trained",
                 "replace that model (a LoRA run's next merged export would add its adapter "
                 "twice)")
    _check_out(out, overwrite=overwrite)   # refused before a large checkpoint is read
    lora = run_lora(run_config, run_file)
    if adapter and lora is None:
        raise HandoffError(f"--adapter exports a LoRA adapter, but {run_dir} trained every "
                           "parameter (its config.json has no actor.lora.rank > 0): leave "
                           "--adapter out to export the full model")
    peft_config = adapter_config(lora, model_dir) if adapter else None   # needs peft
    ckpt = find_checkpoint(run_dir, step)
    config = read_model_config(model_dir, flag=flag)
    with reading(ckpt):
        saved_step = checkpoint_step(ckpt)
        weights = CheckpointPart(ckpt, "model")
    if lora is None:
        _check_fits_model(weights.tensors, model_dir, config, ckpt, flag)
    else:
        fix = None if model is None else ("pass --model the base model this LoRA run trained, "
                                          "or restore the run's config.json")
        pairs = check_adapter(weights.tensors, model_dir, lora, ckpt, fix=fix)
        if not adapter:
            weights = MergedWeights(model_dir, weights, pairs, lora)
    dtype = next(iter(weights.tensors.values())).dtype   # every param in one dtype
    made = first_missing(out)   # the topmost directory this export creates (None: out exists)
    try:
        staging = _fresh_staging(out)
        if adapter:
            write_adapter(weights, pairs, peft_config, staging)
        else:
            _write_weights(weights, staging, tie=bool(config.get("tie_word_embeddings")))
            _write_config(model_dir, config, dtype, staging)
        files = sorted([p.name for p in staging.iterdir()] + [EXPORT_RECORD])
        (staging / EXPORT_RECORD).write_text(json.dumps(
            {"run_dir": str(run_dir.resolve()), "checkpoint": ckpt.name,
             "step": saved_step, "model": str(Path(model_dir).resolve()),
             "lora": None if lora is None else {**asdict(lora), "merged": not adapter},
             "files": files}, indent=1))
        publish(staging, out, replaces=_earlier_export_files(out))   # none left behind
    except BaseException as e:
        shutil.rmtree(made if made is not None else out / STAGING, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_error(out, e, weights) from None
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


def _run_model_dir(run_config: dict, file: Path, model: str | None) -> tuple[str, str]:
    """(the model the run trained as a directory, the name its errors give it): `model`
    (--model) when given, else its config.json's model.path (see _recorded_model)."""
    if model is not None:
        model_dir = resolve_model(model, flag="--model")
        check_model_dir(model_dir, flag="--model")   # its config, tokenizer and weights
        return model_dir, "--model"
    recorded = run_config.get("model")
    path = recorded.get("path") if isinstance(recorded, dict) else None
    if not isinstance(path, str) or not path:
        raise HandoffError(f"{file} does not record model.path (truncated or edited): "
                           "restore the run's config.json, or pass --model DIR, the model the "
                           "run trained")
    flag = "the run's model.path"
    model_dir = _recorded_model(path, file, flag)
    check_model_dir(model_dir, flag=flag)   # its config and tokenizer
    return model_dir, flag


def _recorded_model(path: str, file: Path, flag: str) -> str:
    """The run's model.path as a directory: an absolute path as it is; a preset or a Hub id
    (in the local cache) resolved as the run resolved it. A relative directory, which an
    older run recorded relative to the directory it started in, is refused: the current
    directory may hold another model of that name."""
    if Path(path).is_absolute():
        if not Path(path).exists():
            raise HandoffError(f"{file} records model.path={path!r}, which does not exist (moved "
                               "or removed since the run): pass --model DIR, the model "
                               "directory the run trained (checked against the checkpoint)")
        return resolve_model(path, flag=flag)
    relative = (f"{file} records model.path={path!r}, a relative path (an older run's, "
                "relative to the directory that run started in), and export does not look it "
                "up in the current directory")
    fix = "pass --model DIR, the model directory the run trained (checked against the checkpoint)"
    if Path(path).exists() or Path(path).is_symlink():
        raise HandoffError(f"{relative}: {fix}")
    if path in PRESETS or path == SMOLLM2_PRESET:
        return resolve_model(path, flag=flag)
    if _is_hub_id(path):
        try:
            return resolve_model(path, flag=flag)
        except HandoffError as e:   # a Hub id not in the cache, or an older run's directory
            raise HandoffError(f"{e}; if {path!r} is instead a directory relative to where "
                               f"the run started (as an older run recorded it), {fix}") from None
    raise HandoffError(f"{relative}: {fix}")


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint of `step` under run_dir/checkpoints (None: the latest)."""
    root = run_dir / "checkpoints"
    if step is None:
        latest = _latest(root)
        if latest is None and kept_steps(root):
            raise HandoffError(f"{root}/latest is missing (deleted, or the run stopped before "
                               "publishing a checkpoint): pass --step N of a kept checkpoint "
                               f"(kept steps: {kept_steps(root)})")
        if latest is None:
            raise HandoffError(f"{run_dir} has no complete checkpoint ({root}/latest is "
                               "missing): train with run.checkpoint=true until a step is saved")
        return latest
    if step < 0:
        raise HandoffError(f"--step {step} is negative: pass the step of a saved checkpoint")
    found = [p for p in complete_checkpoints(root) if saved_step(p) == step]
    if not found:
        raise HandoffError(f"{run_dir} has no complete checkpoint of step {step}: it keeps "
                           f"steps {kept_steps(root) or 'none'}; pass one of them to --step, "
                           "or leave --step out for the latest")
    try:
        return max(found, key=lambda p: (p / META).stat().st_mtime)   # saved again: newest
    except FileNotFoundError:   # pruned since it was listed
        raise _removed(found[0]) from None


def kept_steps(root: Path, *, but: Path | None = None) -> list[int]:
    """The steps of the complete checkpoints under `root` now (`but`: less that one)."""
    return sorted({saved_step(p) for p in complete_checkpoints(root) if p != but})


def _latest(root: Path) -> Path | None:
    """The checkpoint `latest` names. A live run may replace `latest` and prune the one it
    named between its read and the check of that directory: then it is read once more."""
    try:
        return latest_checkpoint(root)
    except HandoffError as first:
        try:
            return latest_checkpoint(root)   # the run saved again: `latest` names the new one
        except HandoffError:
            pass
        pointer = root / LATEST
        name = pointer.read_text(errors="replace").strip() if pointer.is_file() else ""
        if CHECKPOINT_NAME.fullmatch(name) and not (root / name / META).is_file():
            raise _removed(root / name, named=True) from None
        raise first


def _removed(ckpt: Path, *, named: bool = False) -> HandoffError:
    """A checkpoint that went while export read it: a live run pruned it (or a hand did)."""
    what = (f"{ckpt.parent / LATEST} names {ckpt.name}, which is gone" if named else
            f"checkpoint {ckpt} was removed while export read it")
    steps = kept_steps(ckpt.parent)
    return HandoffError(f"{what} (the run is still saving and pruning checkpoints, or the "
                        "directory was edited): run the export again, or pass --step N of a "
                        f"kept checkpoint (kept steps: {steps or 'none'})")


def _failure(error: BaseException) -> BaseException:
    """The error inside DCP's CheckpointException (a Ctrl-C raised as itself)."""
    if isinstance(error, CheckpointException):
        for inner, _trace in error.failures.values():
            if isinstance(inner, KeyboardInterrupt):
                raise inner
            return inner
    return error


def _unreadable(ckpt: Path, error: BaseException) -> HandoffError:
    """One line for a checkpoint export could not read: gone, or damaged (with why)."""
    if not (ckpt / META).is_file():   # a prune renames the directory away whole
        return _removed(ckpt)
    if isinstance(error, HandoffError):
        cause = _RESUME_FIX.split(str(error), maxsplit=1)[0]
    else:
        inner = _failure(error)
        said = " ".join(str(inner).split())[:160]
        cause = f"{type(inner).__name__}: {said}" if said else type(inner).__name__
    others = kept_steps(ckpt.parent, but=ckpt)
    fix = (f"pass --step N of another checkpoint (kept steps: {others})" if others else
           "the run keeps no other checkpoint; restore this one from a copy")
    return HandoffError(f"checkpoint {ckpt} cannot be exported: {cause}; {fix}")


@contextmanager
def reading(ckpt: Path):
    """Errors while the checkpoint `ckpt` is read as one line for export (its messages advise
    a resume: "point `latest` at another checkpoint", "--overwrite")."""
    try:
        yield
    except HandoffError as e:
        if not (ckpt / META).is_file() or _RESUME_FIX.search(str(e)):
            raise _unreadable(ckpt, e) from None
        raise
    except (OSError, ValueError, RuntimeError, CheckpointException) as e:
        raise _unreadable(ckpt, e) from None


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
        with reading(self.ckpt), warnings.catch_warnings():   # one process, DCP warns of it
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({self.part: state}, storage_reader=self.reader, no_dist=True)
        return state


def _check_fits_model(tensors: dict[str, torch.Tensor], model_dir: str, config: dict,
                      ckpt: Path, flag: str = "the run's model.path") -> None:
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
            fix = ("pass --model the model the run trained" if flag == "--model" else
                   "point the run's config.json model.path at the model it trained, or pass "
                   "--model DIR")
            raise HandoffError(f"checkpoint {ckpt} does not fit the model {model_dir} "
                               f"({flag}): {name} is {ours.get(name, 'absent')} in the "
                               f"checkpoint, {shapes.get(name, 'absent')} in the model; {fix}")


# ---------------------------------------------------------------- writing DIR


def _check_out(out: Path, *, overwrite: bool) -> None:
    """Refuse a link, a file or (without overwrite) a directory that holds files."""
    if out.is_symlink():
        raise HandoffError(f"--out {str(out)!r} is a symbolic link: export writes only into a "
                           "real directory; pass its target or a new path")
    if out.exists() and not out.is_dir():
        raise HandoffError(f"--out {str(out)!r} is a file, not a directory: pass a directory "
                           "(created if missing)")
    where = next(p for p in (out, *out.parents, Path(".")) if p.exists() or p.is_symlink())
    if not where.is_dir():   # a file on the way: mkdir would fail
        raise HandoffError(f"--out {str(out)!r}: {where} is a file, not a directory: pass an "
                           "--out under a directory")
    if not os.access(where, os.W_OK | os.X_OK):
        raise HandoffError(f"--out {str(out)!r}: {where} is not writable (read-only, or owned "
                           "by another user): pass a directory you can write to")
    refuse_a_run(out, writes="an export")
    used = [p.name for p in out.iterdir() if p.name != STAGING] if out.is_dir() else []
    if used and not overwrite:
        raise HandoffError(f"--out {str(out)!r} already holds files ({', '.join(sorted(used)[:3])}"
                           f"{', ...' if len(used) > 3 else ''}): pass --overwrite to replace "
                           "them, or choose an empty directory")


def _earlier_export_files(out: Path) -> set[str]:
    """The files an earlier export wrote into `out`, which --overwrite replaces (publish
    matches them against the names in `out` only): those its record lists, or for a record
    without the list (written before it was kept) the names that mark a directory's kind,
    config.json and the adapter's."""
    record = out / EXPORT_RECORD
    if not record.is_file():
        return set()
    try:
        listed = json.loads(record.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if not isinstance(listed, list):
        return {"config.json", "generation_config.json", "adapter_config.json",
                "adapter_model.safetensors"}
    return {n for n in listed if isinstance(n, str)}


def _check_apart(read: Path, out: Path, what: str, harm: str) -> None:
    """Refuse a DIR that is `read` (`what`: a directory the export reads) or inside it, or
    that holds it: the export's files would replace what it reads (`harm`)."""
    kept, target = read.resolve(), out.resolve()
    where = (what if target == kept else f"inside {what}" if kept in target.parents
             else f"a directory that holds {what}" if target in kept.parents else None)
    if where is not None:
        raise HandoffError(f"--out {str(out)!r} is {where} {str(read)!r}: the export would "
                           f"{harm}; pass a directory apart from it, e.g. --out exported/")


def _write_error(out: Path, error: OSError, weights) -> HandoffError:
    """One line for a write into --out that failed (what it made is removed by then)."""
    said = error.strerror or str(error)
    where = f" ({error.filename})" if error.filename else ""
    written = Path(out).resolve()
    if error.filename and not (written == Path(str(error.filename)).resolve()
                               or written in Path(str(error.filename)).resolve().parents):
        return HandoffError(f"cannot read {error.filename} ({said}) while exporting to --out "
                            f"{str(out)!r}: check the model directory; the export left nothing "
                            "behind")
    if error.errno in _ROOM:
        need = sum(t.numel() * t.element_size() for t in weights.tensors.values())
        return HandoffError(f"--out {str(out)!r}: the disk is full ({said}{where}); the export "
                            f"needs about {fmt_bytes(need)} and left nothing behind: free space "
                            "there or pass an --out on another disk")
    if error.errno in _DENIED:
        return HandoffError(f"--out {str(out)!r} cannot be written ({said}{where}): pass a "
                            "directory you can write to; the export left nothing behind")
    return HandoffError(f"--out {str(out)!r} cannot be written ({said}{where}): pass another "
                        "directory; the export left nothing behind")


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
        save_tensors(weights.load(shard), staging / file)
        usual_mode(staging / file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: file for file, shard in zip(files, shards) for n in shard}}
        (staging / WEIGHTS_INDEX).write_text(json.dumps(index, indent=1))


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
