"""Atomic checkpoints of the actor: sharded weights + optimizer, step, RNG, data position.

    path = save_checkpoint("runs/x/checkpoints", actor, step=10, extra={"data_pos": 80})
    info = load_checkpoint("runs/x/checkpoints", actor)   # None when there is none yet
    info["step"], info["extra"]["data_pos"]

Layout under the root:
  step_00000010_<id>/   torch.distributed.checkpoint files (every rank's shards of the params
                        and of the fp32 master / Adam moments), rng_rank<r>.pt, meta.json
  latest                the name of the newest complete directory (one line)
A save writes everything into `.tmp_<name>/` with fsync, renames it into place, then replaces
`latest` atomically (write latest.tmp, fsync, rename). A process killed at any moment leaves
`latest` naming a complete checkpoint (or no `latest` at all before the first one); leftover
`.tmp_*` directories are removed by the next save. Loading works on any world size for the
weights and optimizer (DCP reshards); RNG states are restored when the world size matches.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from handoff.errors import HandoffError
from handoff.train.actor import Actor

LATEST = "latest"
KEEP_LAST = 2  # complete checkpoints kept after a publish (preflight counts the disk by it)


def _state(actor: Actor) -> dict:
    """Every tensor to save, as DTensors sharing storage with the live ones (load is in place)."""
    params = dict(actor.module.named_parameters())
    model = {name: p.detach() for name, p in params.items()}
    optim = {}
    for key, t in actor.optimizer.tensors().items():
        p = params[key.rsplit("/", 1)[0]]
        optim[key] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
    return {"model": model, "optim": optim}


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _broadcast(obj: object) -> object:
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(root: str | Path, actor: Actor, *, step: int, extra: dict | None = None,
                    keep: int = KEEP_LAST, publish: bool = True) -> Path:
    """Write a complete checkpoint (collective: every rank calls it); returns its directory.

    With publish=False the checkpoint is complete on disk but `latest` still names the
    previous one until `publish_checkpoint`: a caller that must finish more work (log the
    step's metrics) before the step counts as done publishes afterwards.
    """
    actor._require_on_device("params", "optimizer")
    root = Path(root)
    rank = dist.get_rank()
    name = _broadcast(f"step_{step:08d}_{uuid.uuid4().hex[:8]}" if rank == 0 else None)
    tmp, final = root / f".tmp_{name}", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    # One file per tensor, copied through pageable memory: DCP keeps the host copy of every
    # tensor of a file alive until that file is closed, and its overlapping loader copies
    # into pinned blocks PyTorch's host allocator caches for good; one file per rank ran the
    # device's host out of memory next to our pinned arena (docs/PERF.md). This way a save
    # holds one tensor at a time on the host.
    writer = dcp.FileSystemWriter(tmp, sync_files=True, single_file_per_rank=False,
                                  per_thread_copy_ahead=0)
    dcp.save(_state(actor), storage_writer=writer)
    buf = _serialize(_rng_state(actor.device))
    _write_durable(tmp / f"rng_rank{rank}.pt", buf)
    dist.barrier()
    if rank == 0:
        meta = {"step": step, "optimizer_step": actor.optimizer.step_count,
                "world_size": actor.world_size, "extra": extra or {}}
        _write_durable(tmp / "meta.json", json.dumps(meta).encode())
        _fsync(tmp)
        os.rename(tmp, final)
        _fsync(root)
        if publish:
            publish_checkpoint(final, keep=keep)
    dist.barrier()
    return final


def publish_checkpoint(path: str | Path, *, keep: int = KEEP_LAST) -> None:
    """Point `latest` at the complete checkpoint `path` (atomic; rank 0 only writes)."""
    path = Path(path)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    root = path.parent
    _write_durable(root / f"{LATEST}.tmp", path.name.encode())
    os.replace(root / f"{LATEST}.tmp", root / LATEST)
    _fsync(root)
    _prune(root, keep, path.name)


def _serialize(obj: object) -> bytes:
    bio = io.BytesIO()
    torch.save(obj, bio)
    return bio.getvalue()


def _prune(root: Path, keep: int, newest: str) -> None:
    """Delete complete checkpoints beyond the newest `keep` (never the one `latest` names)."""
    done = sorted((p for p in root.glob("step_*") if (p / "meta.json").is_file()),
                  key=lambda p: (json.loads((p / "meta.json").read_text())["step"], p.stat().st_mtime))
    for old in done[:-max(keep, 1)]:
        if old.name != newest:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory `latest` names, or None when no checkpoint was completed yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise HandoffError(f"{pointer} names {path.name}, which is incomplete or missing: "
                           "the checkpoint directory was edited by hand; point latest at a "
                           "step_* directory that has meta.json")
    return path


def load_checkpoint(root: str | Path, actor: Actor) -> dict | None:
    """Load the latest checkpoint under `root` into `actor` in place (collective).

    Returns {"step", "extra", "path"}, or None when there is nothing to resume from.
    """
    path = latest_checkpoint(root)
    if path is None:
        return None
    actor._require_on_device("params", "optimizer")
    meta = json.loads((path / "meta.json").read_text())
    state = _state(actor)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    except Exception as e:  # DCP reports a shape or key mismatch in many forms
        raise HandoffError(f"checkpoint {path} does not fit this model ({type(e).__name__}): it "
                           "was written by another model.path or dtype; point run.out_dir at a "
                           "fresh directory or resume with the config that wrote it") from e
    actor.optimizer.step_count = meta["optimizer_step"]
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if meta["world_size"] == actor.world_size and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False), actor.device)
    return {"step": meta["step"], "extra": meta["extra"], "path": str(path)}
