"""Pinned staging arena: host buffers allocated once per process, reused every step.

    arena = PinnedArena()
    arena.stage("optim", [t for s in opt.state.values() for t in s.values()])
    t = arena.offload("optim")           # async D2H on the D2H copy stream, device side freed
    ...                                  # the GPU is someone else's now
    arena.onload("optim").wait()         # device storage re-created, async H2D, then wait
    arena.drop("ref", ref_tensors)       # no copy: the host copy is still the truth (frozen sets)

Allocating pinned memory is slow (16 GiB took 7.5 s on the H200), so a named set keeps its
host space for the life of the arena; re-staging a set of the same (or smaller) size reuses
it. The arena moves whole storages, so views, tied weights and optimizer state that share
storage round-trip exactly. Copies are cut into `chunk_bytes` pieces on two dedicated copy
streams (one per direction), so the D2H of one set and the H2D of another run at the same
time on a full-duplex link.

On CPU the "device" tensors are CPU tensors: host buffers are plain memory (pin=False),
copies are synchronous, and `free_device` shrinks each storage to zero bytes (tensor objects,
shapes and identity kept). That a re-created storage lands at the same address is never
promised, on any backend.

On CUDA an offload's device storage is released when its transfer is waited on, not under
`record_stream`, which leaves one event per storage for the caching allocator to query at
its next allocation: thousands of queries inside the weight sync that runs meanwhile
(docs/PERF.md).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from handoff.errors import HandoffError
from handoff.memory.host_copy import copy_from_host

_ALIGN_BYTES = 512  # host offsets aligned for any dtype and for fast DMA


def _unregister_all(buffers: list[torch.Tensor]) -> None:
    """Unpin host buffers before their memory goes back to the C allocator."""
    for buf in buffers:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    buffers.clear()


def _pinned_empty(nbytes: int, registered: list[torch.Tensor]) -> torch.Tensor:
    """Exactly nbytes of page-locked host memory.

    torch.empty(pin_memory=True) rounds every request up to a power of two (a 17 GiB set
    would pin 32 GiB), so we page-lock plain memory with cudaHostRegister instead.
    """
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise HandoffError(f"pinning {nbytes / (1 << 30):.2f} GiB of host memory failed "
                           f"(cudaError {int(err)}): raise `ulimit -l` or free host RAM")
    registered.append(buf)
    return buf


class Transfer:
    """One staged set in flight: `.wait()` blocks until done; `.seconds` is valid after it.

    On CUDA `.event` is recorded on the copy stream after the last chunk; another stream
    can wait on it without blocking the host (`torch.cuda.current_stream().wait_event(t.event)`).
    On CPU the copy already happened and `.event` is None.
    """

    def __init__(self, name: str, nbytes: int, *, start=None, event=None,
                 seconds: float | None = None) -> None:
        self.name = name
        self.bytes = nbytes
        self.event = event
        self._start = start
        self._seconds = seconds
        self.release: list[torch.UntypedStorage] = []   # freed once the copy has landed

    def wait(self) -> None:
        """Block the host until the transfer finished, fill in `.seconds` and free the
        device storage an offload left behind."""
        if self.event is not None:
            self.event.synchronize()
            if self._seconds is None:
                self._seconds = self._start.elapsed_time(self.event) / 1e3
        for storage in self.release:
            storage.resize_(0)
        self.release = []

    def done(self) -> bool:
        """Whether the copy has finished, without blocking (CUDA: its event's query; a CPU
        copy is synchronous, so done when made). `wait()` still lands it."""
        return self.event is None or self.event.query()

    @property
    def seconds(self) -> float:
        """Copy time on its stream (CUDA events) or wall time (CPU); call wait() first."""
        if self._seconds is None:
            raise HandoffError(f"transfer {self.name!r} has no time yet: call .wait() first")
        return self._seconds


@dataclass
class _Set:
    """A named set: its unique storages, their byte sizes and host views."""
    storages: list = field(default_factory=list)    # torch.UntypedStorage, one per unique storage
    nbytes: list[int] = field(default_factory=list)
    device: torch.device | None = None
    host_u8: torch.Tensor | None = None              # the set's host space (capacity >= total)
    views: list[torch.Tensor] = field(default_factory=list)  # uint8 view per storage
    on_device: bool = True
    host_copy: bool = False         # the host space holds the set's data (an offload copied it)
    last: Transfer | None = None    # the latest copy, waited on before the next one starts


def _local(t):
    """A DTensor's (FSDP2 parameter's) local shard; any other tensor itself."""
    return t.to_local() if callable(getattr(t, "to_local", None)) else t


def _storage_bytes(storage, nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage (shares memory with it)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


class PinnedArena:
    """Per-process pinned host space for named tensor sets, with async offload/onload.

    pin: page-lock host buffers (default: when CUDA is available).
    chunk_bytes: largest single copy; smaller chunks interleave the two directions.
    """

    def __init__(self, *, pin: bool | None = None, chunk_bytes: int = 64 << 20) -> None:
        if chunk_bytes <= 0:
            raise HandoffError(f"chunk_bytes={chunk_bytes} must be positive: pass e.g. 64 << 20")
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.chunk_bytes = chunk_bytes
        self._sets: dict[str, _Set] = {}
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}
        self._registered: list[torch.Tensor] = []
        if self.pin:
            weakref.finalize(self, _unregister_all, self._registered)

    # ---- binding -------------------------------------------------------------------------

    def stage(self, name: str, tensors: list[torch.Tensor]) -> None:
        """(Re)bind `name` to these tensors; host space is reserved once and reused.

        Tensors sharing one storage are staged once (the whole storage moves). All tensors
        of a set live on one device, and the set must be on the device (not offloaded).
        A DTensor (FSDP2 parameter) stands for its local shard (`to_local()`).
        """
        old = self._sets.get(name)
        if old is not None and not old.on_device:
            raise HandoffError(f"set {name!r} is offloaded: onload it before staging it again")
        if old is not None:
            self._settled(name)   # its host space may be handed on below
        new = _Set()
        seen: set[int] = set()
        for t in map(_local, tensors):
            if not isinstance(t, torch.Tensor):
                raise HandoffError(f"set {name!r}: got {type(t).__name__}, expected tensors")
            if new.device is None:
                new.device = t.device
            elif t.device != new.device:
                raise HandoffError(f"set {name!r} mixes {new.device} and {t.device}: stage "
                                   "one set per device")
            storage = t.untyped_storage()
            if storage._cdata in seen:
                continue
            if storage.nbytes() == 0 and t.numel() > 0:
                raise HandoffError(f"set {name!r}: a tensor of shape {tuple(t.shape)} has no "
                                   "storage (already offloaded elsewhere?): onload it first")
            seen.add(storage._cdata)
            new.storages.append(storage)
            new.nbytes.append(storage.nbytes())
        offsets, total = [], 0
        for n in new.nbytes:
            offsets.append(total)
            total += -(-n // _ALIGN_BYTES) * _ALIGN_BYTES
        if old is not None and old.host_u8 is not None and old.host_u8.numel() >= total:
            new.host_u8 = old.host_u8
        else:
            if old is not None and old.host_u8 is not None:
                self._drop_host(old.host_u8)
            new.host_u8 = (_pinned_empty(total, self._registered) if self.pin
                           else torch.empty(total, dtype=torch.uint8))
        new.views = [new.host_u8[o:o + n] for o, n in zip(offsets, new.nbytes)]
        self._sets[name] = new

    def _drop_host(self, buf: torch.Tensor) -> None:
        if any(buf is b for b in self._registered):
            torch.cuda.synchronize()  # no copy may still be reading or writing it
            self._registered[:] = [b for b in self._registered if b is not buf]
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def close(self) -> None:
        """Unpin and drop every host buffer (the arena is empty afterwards)."""
        if self._registered:
            torch.cuda.synchronize()
            _unregister_all(self._registered)
        self._sets.clear()

    def names(self) -> list[str]:
        """Names of the staged sets, in staging order."""
        return list(self._sets)

    def bytes_staged(self) -> int:
        """Host bytes reserved by all sets (pinned when `pin`), whether in use or not."""
        return sum(s.host_u8.numel() for s in self._sets.values() if s.host_u8 is not None)

    def set_bytes(self, name: str) -> int:
        """Payload bytes of one set (sum of its unique storages)."""
        return sum(self._get(name).nbytes)

    def offload(self, name: str, *, free_device: bool = True) -> Transfer:
        """Copy the set to host (async on CUDA); with free_device, release its device storage
        once the copy has read it: at once on CPU, at the transfer's `wait()` on CUDA (the
        module docstring says why), so wait before counting on that memory."""
        s = self._settled(name)
        if not s.on_device:
            raise HandoffError(f"set {name!r} is already offloaded: onload it first")
        transfer = self._copy(name, s, to_host=True)
        s.host_copy = True   # complete once `last` is waited on, which every later use does
        if free_device:
            transfer.release = list(s.storages)
            if transfer.event is None:
                transfer.wait()
            s.on_device = False
        return transfer

    def drop(self, name: str, tensors: list[torch.Tensor]) -> Transfer:
        """Free the set's device storage without a copy: the host copy of its last offload is
        the truth. Only for data the device never changes (a frozen model's weights): a change
        made since that offload would be lost. `tensors` are the set's tensors as its owner
        sees them now, refused unless they are the staged ones (same storages). Returns a
        0-byte Transfer, already done."""
        s = self._settled(name)
        if not s.on_device:
            raise HandoffError(f"set {name!r} is already offloaded: onload it first")
        if not s.host_copy:
            raise HandoffError(f"set {name!r} has no host copy to keep (never offloaded since it "
                               "was staged): offload it with a copy once, then drop it")
        staged = {st._cdata for st in s.storages}
        if {_local(t).untyped_storage()._cdata for t in tensors} != staged:
            raise HandoffError(f"set {name!r}: its tensors are no longer the staged ones (their "
                               "storage changed since): offload them with a copy, which stages "
                               "them again")
        t0 = time.perf_counter()
        for storage in s.storages:
            storage.resize_(0)
        s.on_device = False
        return Transfer(name, 0, seconds=time.perf_counter() - t0)

    def onload(self, name: str, *, by_kernel: bool = False,
               programs: int | None = None) -> Transfer:
        """Re-create freed device storage (same sizes), then copy the host data back.

        by_kernel: the copy is done by a kernel reading the pinned host memory
        (handoff.memory.host_copy), not by the copy engines: right after a large region's
        sleep the copy engines are busy and run at half the link's rate. programs: the
        kernel runs on that many programs (host_copy.copy_from_host)."""
        s = self._settled(name)
        if not s.on_device:
            for storage, n in zip(s.storages, s.nbytes):
                storage.resize_(n)
            s.on_device = True
        return self._copy(name, s, to_host=False, by_kernel=by_kernel, programs=programs)

    def _get(self, name: str) -> _Set:
        if name not in self._sets:
            raise HandoffError(f"no staged set {name!r} (staged: {self.names()}): call "
                               "arena.stage(name, tensors) first")
        return self._sets[name]

    def _settled(self, name: str) -> _Set:
        """The set, its latest copy waited on: the way back must not start before the way
        out landed (and freed its pages), nor an offload read what an onload still writes."""
        s = self._get(name)
        if s.last is not None:
            s.last.wait()
            s.last = None
        return s

    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        key = (device.index if device.index is not None else torch.cuda.current_device(),
               direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=key[0])
        return self._streams[key]

    def _copy(self, name: str, s: _Set, *, to_host: bool, by_kernel: bool = False,
              programs: int | None = None) -> Transfer:
        total = sum(s.nbytes)
        pairs = [(_storage_bytes(st, n, s.device), v)
                 for st, n, v in zip(s.storages, s.nbytes, s.views) if n > 0]
        if s.device is None or s.device.type != "cuda":
            t0 = time.perf_counter()
            for dev_u8, host_u8 in pairs:
                (host_u8 if to_host else dev_u8).copy_(dev_u8 if to_host else host_u8)
            return Transfer(name, total, seconds=time.perf_counter() - t0)
        stream = self._stream(s.device, "d2h" if to_host else "h2d")
        # The copy stream must see every kernel that produced (or last read) the data.
        stream.wait_stream(torch.cuda.current_stream(s.device))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for dev_u8, host_u8 in pairs:
                for lo in range(0, dev_u8.numel(), self.chunk_bytes):
                    hi = min(lo + self.chunk_bytes, dev_u8.numel())
                    if to_host:
                        host_u8[lo:hi].copy_(dev_u8[lo:hi], non_blocking=self.pin)
                    elif by_kernel and self.pin:
                        copy_from_host(dev_u8[lo:hi], host_u8[lo:hi], programs=programs)
                    else:
                        dev_u8[lo:hi].copy_(host_u8[lo:hi], non_blocking=self.pin)
            end.record(stream)
        s.last = Transfer(name, total, start=start, event=end)
        return s.last
