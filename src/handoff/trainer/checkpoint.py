"""Atomic checkpoints of the actor: sharded weights + optimizer, step, RNG, data position.

    path = save_checkpoint("runs/x/checkpoints", actor, step=10, extra={"data_pos": 80})
    info = load_checkpoint("runs/x/checkpoints", actor)   # None when there is none yet
    info["step"], info["extra"]["data_pos"]

Layout under the root:
  step_00000010_<id>/   torch.distributed.checkpoint files (every rank's shards of the params
                        and of the fp32 master / Adam moments), rng_rank<r>.json, meta.json
                        (under LoRA: the adapters and their optimizer state only, meta.json's
                        `lora` names rank, alpha and targets; a full checkpoint has lora null)
  latest                the name of the newest complete directory (one line); a resume that
                        finds it gone takes the newest complete step_* of a logged step
                        (newest_complete_checkpoint, run_dir.resume_point)
A save writes everything into `.tmp_<name>/` with fsync, renames it into place, then replaces
`latest` atomically (write latest.tmp, fsync, rename). A process killed at any moment leaves
`latest` naming a complete checkpoint (or no `latest` at all before the first one). A prune
renames an old checkpoint to `.trash_<name>` before deleting it, so a kill inside the delete
leaves no half-deleted `step_*`; leftover `.tmp_*` and `.trash_*` directories are removed by
the next save, prune or load. A Ctrl-C inside DCP (which wraps it in a CheckpointException)
comes out as the KeyboardInterrupt it was. Files are written without following a symbolic
link (safe_files.py): a planted `latest.tmp` or a linked checkpoints directory is refused.
Loading works on any world size for the weights and optimizer (DCP reshards); RNG states
are restored when the world size matches.

What a load trusts (checkpoint_files.py): `latest` must name a directory of its own root;
meta.json (JSON) records the model's identity, checked before anything loads, and the sha256
of every other file, checked before DCP opens one; DCP's pickled `.metadata` is read with an
allow-list of classes; RNG states are JSON. A save that fails for want of disk space says
so, how much it needed, and that the previous checkpoint is intact.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from handoff.dist import broadcast_object
from handoff.errors import HandoffError
from handoff.safe_files import (failing_write_is_one_line, make_dirs, open_for_writing,
                                replace_file)
from handoff.trainer.actor import Actor
from handoff.trainer.checkpoint_files import (FILE_OVERHEAD_BYTES, FORMAT, META, RNG_FILE_BYTES,
                                            SafeReader, check_identity, file_hashes,
                                            model_identity, read_json, rng_state,
                                            set_rng_state, verify_files)

LATEST = "latest"
KEEP_LAST = 2  # complete checkpoints kept after a publish (the default of run.keep_checkpoints)
LEFTOVERS = (".tmp_*", ".trash_*")   # a save or a prune a kill cut short
# What `latest` may name (no path, no dots); group 1: the step it was saved at.
CHECKPOINT_NAME = re.compile(r"step_(\d+)_[A-Za-z0-9]+")


def _state(actor: Actor) -> dict:
    """Every tensor to save, sharing storage with the live ones (load is in place): DTensors
    of FSDP's shards, or a LoRA replica's whole tensors. Under LoRA the `model` part is the
    adapters only (trainer/lora.py's names), never the frozen base."""
    params = dict(actor.module.named_parameters())
    model = {name: p.detach() for name, p in params.items()
             if actor.lora is None or p.requires_grad}
    optim = {}
    for key, t in actor.optimizer.tensors().items():
        p = params[key.rsplit("/", 1)[0]]
        optim[key] = t if not isinstance(p, DTensor) else DTensor.from_local(
            t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return {"model": model, "optim": optim}


def lora_meta(actor: Actor) -> dict | None:
    """What meta.json records of a LoRA checkpoint (None: full parameters); a resume must
    match it."""
    lora = actor.lora
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open_for_writing(path, path.parent) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove_leftovers(root: Path) -> None:
    """Delete what a save or a prune cut short by a kill left (never through a link)."""
    for pattern in LEFTOVERS:
        for stale in root.glob(pattern):
            if stale.is_symlink():
                stale.unlink()
            else:
                shutil.rmtree(stale, ignore_errors=True)


def save_checkpoint(root: str | Path, actor: Actor, *, step: int, extra: dict | None = None,
                    keep: int = KEEP_LAST, publish: bool = True) -> Path:
    """Write a complete checkpoint (collective: every rank calls it); returns its directory.

    With publish=False the checkpoint is complete on disk but `latest` still names the
    previous one until `publish_checkpoint`: a caller that must finish more work (log the
    step's metrics) before the step counts as done publishes afterwards.
    """
    actor.require_on_device("params", "optimizer")
    root = Path(root)
    rank = dist.get_rank()
    name = broadcast_object(f"step_{step:08d}_{uuid.uuid4().hex[:8]}" if rank == 0 else None)
    tmp, final = root / f".tmp_{name}", root / name
    if rank == 0:
        root.parent.mkdir(parents=True, exist_ok=True)
        make_dirs(root, root.parent)   # a linked checkpoints directory is refused
        _remove_leftovers(root)
        tmp.mkdir()
    dist.barrier()
    # One file per tensor, copied through pageable memory: DCP keeps the host copy of every
    # tensor of a file alive until that file is closed, and its overlapping loader copies
    # into pinned blocks PyTorch's host allocator caches for good; one file per rank ran the
    # device's host out of memory next to our pinned arena (docs/PERF.md). This way a save
    # holds one tensor at a time on the host.
    writer = dcp.FileSystemWriter(tmp, sync_files=True, single_file_per_rank=False,
                                  per_thread_copy_ahead=0)
    try:
        dcp.save(_state(actor), storage_writer=writer)
        _write_durable(tmp / f"rng_rank{rank}.json", json.dumps(rng_state(actor.device)).encode())
        dist.barrier()
        if rank == 0:
            meta = {"format": FORMAT, "step": step, "optimizer_step": actor.optimizer.step_count,
                    "world_size": actor.world_size, "extra": extra or {},
                    "model": model_identity(actor.module, actor.dtype),
                    "lora": lora_meta(actor), "files": file_hashes(tmp)}
            _write_durable(tmp / META, json.dumps(meta).encode())
            _fsync(tmp)
    except (Exception, CheckpointException, KeyboardInterrupt) as e:   # DCP's: BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_interrupt(e)
        if _is_disk_full(e, root, checkpoint_bytes(actor)):
            raise HandoffError(_disk_full_message(root, step, checkpoint_bytes(actor))) from e
        raise
    dist.barrier()
    if rank == 0:
        os.rename(tmp, final)
        _fsync(root)
        if publish:
            publish_checkpoint(final, keep=keep)
    dist.barrier()
    return final


def checkpoint_bytes(actor: Actor) -> int:
    """Bytes one checkpoint of `actor` takes on disk (all ranks): its tensors, each file's
    overhead and the ranks' RNG states (preflight estimates the same from the model shape)."""
    state = _state(actor)
    tensors = [t for part in state.values() for t in part.values()]
    return (sum(t.numel() * t.element_size() for t in tensors)
            + len(tensors) * FILE_OVERHEAD_BYTES + actor.world_size * RNG_FILE_BYTES)


def _adapter(lora: object) -> object:
    """A lora_meta with its target_modules as a set, as peft takes them: a checkpoint written
    before the config kept them once each in one order may list them otherwise."""
    modules = lora.get("target_modules") if isinstance(lora, dict) else None
    if isinstance(modules, list) and all(isinstance(m, str) for m in modules):
        return {**lora, "target_modules": set(modules)}
    return lora


def _kind(lora: object) -> str:
    if not isinstance(lora, dict):
        return "full parameters"
    return (f"a LoRA adapter (rank {lora.get('rank')}, alpha {lora.get('alpha')}, "
            f"{', '.join(map(str, lora.get('target_modules') or []))})")


def _causes(error: BaseException) -> list[BaseException]:
    """`error`, its causes and contexts, and every rank's failure a CheckpointException holds."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    return seen


def _raise_interrupt(error: BaseException) -> None:
    """Raise a Ctrl-C, also one DCP wrapped, as itself (the CLI's one line and exit 130)."""
    if any(isinstance(e, KeyboardInterrupt) for e in _causes(error)):
        raise KeyboardInterrupt from None


def _is_disk_full(error: BaseException, root: Path, need: int) -> bool:
    """Whether a failed save ran out of disk: ENOSPC (or a quota, a file size limit) anywhere
    in the error, torch's zip writer's "file write failed" / "unexpected pos" (a short write),
    or less free space than a checkpoint needs."""
    seen = _causes(error)
    for e in seen:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if any(text in str(e) for text in ("No space left", "file write failed",
                                            "unexpected pos", "quota")):
            return True
    return _free_bytes(root) < need


def _free_bytes(root: Path) -> int:
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def _disk_full_message(root: Path, step: int, need: int) -> str:
    try:
        last = latest_checkpoint(root)
    except HandoffError:
        last = None
    kept = (f"the last checkpoint ({last.name}, step {checkpoint_step(last)}) is intact"
            if last is not None else "no earlier checkpoint exists")
    return (f"checkpoint step {step} could not be written to {root}: the disk is full (one "
            f"checkpoint needs {_size(need)}, {_size(_free_bytes(root))} are free); {kept}: "
            "free some space (or set run.checkpoint=false) and resume with --resume")


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def publish_checkpoint(path: str | Path, *, keep: int = KEEP_LAST) -> None:
    """Point `latest` at the complete checkpoint `path` (atomic; rank 0 only writes)."""
    path = Path(path)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    root = path.parent
    with failing_write_is_one_line(root / LATEST, "it still names the previous checkpoint"):
        replace_file(root / LATEST, path.name.encode(), root)   # latest.tmp, fsync, rename
    _prune(root, keep, path.name)


def _prune(root: Path, keep: int, newest: str) -> None:
    """Delete complete checkpoints beyond the newest `keep` (never the one `latest` names):
    each is renamed to `.trash_<name>` first, then deleted (a kill between leaves a name
    the next save, prune or load removes)."""
    done = sorted(complete_checkpoints(root), key=lambda p: (saved_step(p), p.stat().st_mtime))
    for old in done[:-max(keep, 1)]:
        if old.name != newest:
            os.rename(old, root / f".trash_{old.name}")
    _fsync(root)
    _remove_leftovers(root)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory `latest` names, or None when no checkpoint was completed yet.

    `latest` must name a directory of `root` itself (step_<n>_<id>: no path, no `..`, no
    symbolic link out of it)."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_symlink():
        raise HandoffError(f"{pointer} is a symbolic link: handoff writes it as a file naming "
                           "a step_* directory next to it; replace it with such a file")
    if not pointer.is_file():
        return None
    name = pointer.read_text(errors="replace").strip()
    path = root / name
    if not CHECKPOINT_NAME.fullmatch(name) or path.is_symlink() or path.resolve().parent != root.resolve():
        raise HandoffError(f"{pointer} names {name[:80]!r}, not a step_* directory of {root}: "
                           "a checkpoint is only read from its own directory; point latest at "
                           "one of its step_* directories")
    if not (path / META).is_file():
        raise HandoffError(f"{pointer} names {path.name}, which is incomplete or missing: "
                           "the checkpoint directory was edited by hand; point latest at a "
                           "step_* directory that has meta.json")
    return path


def complete_checkpoints(root: Path) -> list[Path]:
    """The step_* directories of `root` that hold a meta.json (a save renames them whole), by
    name; none through a link, none when `root` is gone (a live run may prune meanwhile)."""
    try:
        names = sorted(root.iterdir()) if root.is_dir() else []
    except FileNotFoundError:
        return []
    return [p for p in names if CHECKPOINT_NAME.fullmatch(p.name) and not p.is_symlink()
            and (p / META).is_file()]


def saved_step(path: Path) -> int:
    """The step a checkpoint directory's name says it was saved at."""
    return int(CHECKPOINT_NAME.fullmatch(path.name).group(1))


def newest_complete_checkpoint(root: str | Path, *, at_most: int) -> Path | None:
    """The complete step_* directory of the highest step up to `at_most` (the later one of a
    step saved twice), or None: what a resume takes when `latest` itself is gone (as Hugging
    Face's Trainer takes its highest checkpoint-N). `at_most`: the last step the run logged;
    a checkpoint past it was never published (its step did not finish: run.Run._save)."""
    done = [p for p in complete_checkpoints(Path(root)) if saved_step(p) <= at_most]
    return max(done, key=lambda p: (saved_step(p), p.stat().st_mtime, p.name), default=None)


def checkpoint_step(path: Path) -> int:
    """The step a complete checkpoint directory was saved at (one line if meta.json is bad,
    or records another step than the directory's name)."""
    return _valid_step(path, read_json(path / META, "checkpoint's meta.json"))


def checkpoint_meta(path: Path) -> dict:
    """meta.json of the complete checkpoint `path`, checked as far as it can be without the
    model: its format, its step against the directory's name, its world size and optimizer
    step (a hand edit is one line, before anything loads)."""
    meta = read_json(path / META, "checkpoint's meta.json")
    if meta.get("format") != FORMAT:
        raise HandoffError(f"{path} was written by an older handoff (format "
                           f"{meta.get('format', 1)}, without file hashes): it cannot be "
                           "verified; resume it with the handoff that wrote it, or start over "
                           "with --overwrite")
    _valid_step(path, meta)
    for key, least in (("world_size", 1), ("optimizer_step", 0)):
        value = meta.get(key)
        if type(value) is not int or value < least:
            raise HandoffError(f"{path / META} has no valid {key} ({value!r}, a whole number "
                               f">= {least}): meta.json was edited by hand; point `latest` at "
                               "another checkpoint, or restore meta.json")
    return meta


def _valid_step(path: Path, meta: dict) -> int:
    step = meta.get("step")
    if type(step) is not int or step < 0:
        raise HandoffError(f"{path / META} has no valid step ({step!r}): point `latest` at "
                           "another checkpoint")
    if CHECKPOINT_NAME.fullmatch(path.name) and saved_step(path) != step:
        raise HandoffError(f"{path / META} records step {step} but its directory was saved at "
                           f"step {saved_step(path)}: meta.json was edited by hand; "
                           "point `latest` at another checkpoint, or restore meta.json")
    return step


def _on_rank0(check) -> None:
    """Run `check` on rank 0 and raise its HandoffError on every rank (none waits alone)."""
    error = None
    if dist.get_rank() == 0:
        try:
            check()
        except HandoffError as e:
            error = str(e)
    error = broadcast_object(error)
    if error is not None:
        raise HandoffError(error)


def load_checkpoint(root: str | Path, actor: Actor, *, path: Path | None = None) -> dict | None:
    """Load the latest checkpoint under `root` (or `path`, one of its step_* directories) into
    `actor` in place (collective).

    Returns {"step", "extra", "path"}, or None when there is nothing to resume from. Before
    anything is read into the actor: meta.json's format, step, counts and the model's
    identity, then every file against its sha256 (rank 0), then DCP's metadata through the
    allow-list."""
    path = path or latest_checkpoint(root)
    if path is None:
        return None
    actor.require_on_device("params", "optimizer")
    meta = checkpoint_meta(path)
    step = meta["step"]
    if _adapter(meta.get("lora")) != _adapter(lora_meta(actor)):
        raise HandoffError(f"checkpoint {path} holds {_kind(meta.get('lora'))}, this run trains "
                           f"{_kind(lora_meta(actor))}: resume with the actor.lora settings that "
                           "wrote it, or start over with --overwrite")
    check_identity(path, meta.get("model"), model_identity(actor.module, actor.dtype))
    _on_rank0(lambda: verify_files(path, meta.get("files")))
    if dist.get_rank() == 0:
        _remove_leftovers(Path(root))
    reader = SafeReader(path, meta["files"])
    reader.check()
    try:
        dcp.load(_state(actor), storage_reader=reader)
    except (Exception, CheckpointException) as e:   # DCP's errors derive from BaseException
        _raise_interrupt(e)
        raise HandoffError(f"checkpoint {path} does not fit this model ({type(e).__name__}): it "
                           "was written by another model.path or dtype; point run.out_dir at a "
                           "fresh directory or resume with the config that wrote it") from None
    actor.optimizer.step_count = meta["optimizer_step"]
    rng_file = path / f"rng_rank{dist.get_rank()}.json"
    if meta.get("world_size") == actor.world_size and rng_file.is_file():
        set_rng_state(rng_file, actor.device)
    return {"step": step, "extra": meta.get("extra", {}), "path": str(path)}
