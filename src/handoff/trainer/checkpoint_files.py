"""What a checkpoint directory may hold, and how a resume reads each file without running code.

    hashes = file_hashes(tmp_dir)                  # at save: sha256 of every file but meta.json
    verify_files(path, meta["files"])              # at load, before DCP opens anything
    dcp.load(state, storage_reader=SafeReader(path, meta["files"]))

A resume reads `latest` (a plain directory name, see checkpoint.py), and in the directory it
names:
* meta.json: JSON (step, data position, the model's identity, the sha256 of every other file);
* rng_rank<r>.json: the torch / Python / NumPy (/ CUDA) generator states as JSON;
* DCP's `.metadata`, a pickle that torch would read with plain `pickle.load`, and its shards
  (`__<rank>_<i>.distcp`), tensors that torch reads with `torch.load(weights_only=True)`.
Every file but meta.json must match the sha256 meta.json recorded at save, or the resume is
refused before any is read: a damaged, truncated or swapped file is named in one line. And
`.metadata` is unpickled here with an allow-list of the classes DCP's metadata is made of, so
a planted `__reduce__` payload is refused before it can run even if meta.json was rewritten
to match; a shard may only be one of the hashed files. The only call the list allows
besides constructors is `getattr(enum class, member name)` on DCP's own enum (how CPython
3.11.0-3.11.3 pickle an enum member); 3.13's `pathlib._local` paths read as `pathlib`'s.
What that does not cover: someone who can write the checkpoint can still change the weights
(README: what a checkpoint may be trusted for).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import io
import json
import os
import pickle
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, Metadata,
                                                   StorageMeta)

from handoff.errors import HandoffError

META = "meta.json"
FORMAT = 2   # 1: RNG states pickled with torch.save and no file hashes (refused: unverifiable)
# Bytes a DCP file adds to its tensor (torch.save's zip records, 64-byte alignment) plus the
# tensor's entry in .metadata: measured 1577 + ~350 bytes on torch 2.13, rounded up.
FILE_OVERHEAD_BYTES = 2048
RNG_FILE_BYTES = 32 << 10   # one rank's generator states as JSON (~21 KB on CPU)


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, or one line naming the file when it is damaged."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise HandoffError(f"{path} is missing: the {what} is incomplete; point `latest` at "
                           "another checkpoint or start over with --overwrite") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HandoffError(f"{path} is not valid JSON ({e.__class__.__name__}: truncated or "
                           f"edited): the {what} cannot be read; point `latest` at another "
                           "checkpoint or start over with --overwrite") from None
    if not isinstance(data, dict):
        raise HandoffError(f"{path} holds {type(data).__name__}, not the JSON object of a "
                           f"{what}: point `latest` at another checkpoint")
    return data


# ---------------------------------------------------------------- file hashes


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):   # hashlib releases the GIL: files hash in parallel
            h.update(chunk)
    return h.hexdigest()


def file_hashes(directory: Path) -> dict[str, str]:
    """{name: sha256} of every file in `directory` but meta.json."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != META)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda n: _sha256(directory / n), names)))


def verify_files(directory: Path, recorded: object) -> None:
    """Raise naming the first file that is missing or differs from its recorded sha256."""
    if not isinstance(recorded, dict) or not recorded:
        raise HandoffError(f"{directory / META} records no file hashes: the checkpoint cannot "
                           "be verified; start over with --overwrite")
    for name, digest in sorted(recorded.items()):
        path = directory / str(name)
        if os.sep in str(name) or name in ("", ".", "..") or path.is_symlink():
            raise HandoffError(f"{directory / META} lists {name!r}, not a plain file of the "
                               "checkpoint: the checkpoint was tampered with; do not resume it")
        if not path.is_file():
            raise HandoffError(f"{path} is missing: the checkpoint is incomplete; point `latest` "
                               "at another checkpoint or start over with --overwrite")
        if _sha256(path) != digest:
            raise HandoffError(f"{path} does not match the sha256 recorded at save (truncated, "
                               "damaged or replaced): the checkpoint is refused; point `latest` "
                               "at another checkpoint or start over with --overwrite")


# ---------------------------------------------------------------- DCP's .metadata


def _allowed(module: str, name: str) -> bool:
    """The classes and helpers a DCP .metadata pickle is made of (torch 2.11-2.13)."""
    if module == "torch.distributed.checkpoint.metadata":
        return name in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                        "_MEM_FORMAT_ENCODING")
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                              ("torch.serialization", "_get_layout"),
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                              ("collections", "OrderedDict")}


# Python 3.13 pickles paths from the module that defines them now; earlier ones lack it.
_PATH_MODULES = ("pathlib._local",)
# The enums DCP's metadata holds. CPython 3.11.0-3.11.3 pickle an enum member as
# `getattr(EnumClass, "NAME")`; later ones call the class with the member's value.
_ENUMS = (_MEM_FORMAT_ENCODING,)


def _enum_member(cls: object, name: object) -> enum.Enum:
    """What `builtins.getattr` may do in a metadata pickle: name a member of an allowed enum."""
    if cls not in _ENUMS or not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, "
                                     f"{str(name)[:40]!r}) is not a member of an enum of DCP's "
                                     "metadata")
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module in _PATH_MODULES and name in ("PosixPath", "PurePosixPath"):
            module = "pathlib"
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose .metadata is unpickled with an allow-list, and whose shards can
    only be files meta.json hashed (torch reads them with weights_only=True).

    `check()` reads and vets the metadata before `dcp.load` (whose own errors come wrapped
    in a CheckpointException); DCP then gets that vetted copy."""

    def __init__(self, path: str | os.PathLike, hashed: dict[str, str]):
        super().__init__(path)
        self.hashed = set(hashed)
        self._metadata: Metadata | None = None

    def check(self) -> None:
        path = Path(self._get_metadata_path())
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except Exception as e:   # UnpicklingError, or a damaged stream's many errors
            raise HandoffError(f"{path} is not a DCP metadata file handoff accepts ({e}): the "
                               "checkpoint is refused and nothing in it was run; do not "
                               "resume it") from None
        if not isinstance(metadata, Metadata):
            raise HandoffError(f"{path} holds {type(metadata).__name__}, not DCP metadata: "
                               "the checkpoint is refused; do not resume it")
        files = {getattr(info, "relative_path", None)
                 for info in (metadata.storage_data or {}).values()}
        if not files <= self.hashed:
            raise HandoffError(f"{path} points at files meta.json did not hash: the checkpoint "
                               "is refused; do not resume it")
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        assert self._metadata is not None, "SafeReader.check() runs before dcp.load"
        self._metadata.storage_meta = self._metadata.storage_meta or StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


# ---------------------------------------------------------------- RNG states as JSON


def _tensor_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _b64_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state(device: torch.device) -> dict:
    """This process's generator states in plain JSON types."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": _tensor_b64(torch.get_rng_state()),
             "python": [version, list(internal), gauss],
             "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]}
    if device.type == "cuda":
        state["cuda"] = _tensor_b64(torch.cuda.get_rng_state(device).cpu())
    return state


def set_rng_state(path: Path, device: torch.device) -> None:
    """Restore the generator states rng_state wrote to `path`; one line naming it if damaged."""
    state = read_json(path, "checkpoint's RNG state")
    try:
        version, internal, gauss = state["python"]
        python_state = (int(version), tuple(int(k) for k in internal), gauss)
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy_state = (str(name), np.array(keys, dtype=np.uint32), int(pos), int(has_gauss),
                       float(cached))
        torch_state = _b64_tensor(state["torch"])
        cuda_state = _b64_tensor(state["cuda"]) if "cuda" in state else None
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise HandoffError(f"{path} is not an RNG state handoff wrote ({e.__class__.__name__}: "
                           f"{e}): point `latest` at another checkpoint") from None
    if device.type == "cuda" and cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, device)


# ---------------------------------------------------------------- the model's identity


def model_identity(module: torch.nn.Module, dtype: torch.dtype) -> dict:
    """Architecture, dtype and every parameter's full shape: what a checkpoint must fit."""
    return {"model_type": getattr(module.config, "model_type", None),
            "dtype": str(dtype).removeprefix("torch."),
            "params": {name: list(p.shape) for name, p in module.named_parameters()}}


def check_identity(path: Path, recorded: object, current: dict) -> None:
    """Raise naming the first difference between a checkpoint's model and this run's."""
    fix = ("resume with the model.path and model.dtype that wrote it, or start over with "
           "--overwrite")
    if not isinstance(recorded, dict):
        raise HandoffError(f"{path / META} records no model identity: {fix}")
    for key, what in (("model_type", "architecture"), ("dtype", "dtype")):
        if recorded.get(key) != current[key]:
            raise HandoffError(f"checkpoint {path} does not fit this model: its {what} is "
                               f"{recorded.get(key)}, this run's is {current[key]}; {fix}")
    theirs, ours = recorded.get("params") or {}, current["params"]
    for name in sorted(set(theirs) | set(ours)):
        if theirs.get(name) != ours.get(name):
            raise HandoffError(f"checkpoint {path} does not fit this model: {name} is "
                               f"{theirs.get(name, 'absent')} there, {ours.get(name, 'absent')} "
                               f"here; {fix}")
