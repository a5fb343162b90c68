"""Tagged memory regions that sleep (release their memory) and wake up again.

    pool = RegionPool("cuda", meter=meter)
    with pool.region("weights"):
        model = build_model()                  # allocations land in the `weights` region
    pool.track("weights", model)               # what level 1 keeps and what CPU releases
    pool.sleep(["weights"], level=1)           # contents -> pinned host arena, memory released
    pool.wake_up(["weights"])                  # memory mapped again, contents copied back

An elastic tag (`pool.elastic(tag, arena, ...)`, memory/elastic.py) has no fixed size: a
wake maps what the device has free less the margin (at least the tag's minimum), `grow(tag)`
maps more as memory frees up, a sleep unmaps all of it; its bytes are what is mapped now.

Levels: 1 backs up the tracked tensors of the tags to this pool's PinnedArena, then
releases; 2 only releases (contents undefined after wake). Sleeping a sleeping tag or waking
an awake one is a no-op. A wake first checks that the driver has room for the region plus
`wake_margin_bytes` of margin and refuses before mapping anything; if it fails later, the
tags it already mapped go back to sleep, so nothing is left half-awake.

Backends:
* CUDA: torch_memory_saver 0.0.10 in `torch` hook mode. Release is cuMemUnmap of the
  physical pages; virtual addresses are kept, so data_ptr() values and CUDA graphs captured
  over region tensors stay valid across sleep/wake. Level 2 releases everything allocated
  inside the region, tracked or not.
* CPU: allocations cannot be intercepted, so a region is exactly its tracked tensors; sleep
  shrinks their storages to zero bytes (shapes and tensor identity kept) and wake re-creates
  them. Address stability is a CUDA-only promise: on CPU data_ptr() changes across a wake.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from handoff.dist import with_index
from handoff.errors import HandoffError
from handoff.memory.allocator import host_memory
from handoff.memory.staging import PinnedArena
from handoff.units import fmt_bytes

def _storages(obj) -> list:
    """Unique untyped storages of a module (params + buffers) or an iterable of tensors."""
    if isinstance(obj, torch.nn.Module):
        tensors = [*obj.parameters(), *obj.buffers()]
    elif isinstance(obj, torch.Tensor):
        tensors = [obj]
    else:
        tensors = list(obj)
    out, seen = [], set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise HandoffError(f"track() got a {type(t).__name__}: pass an nn.Module or tensors")
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            out.append((t, storage))
    return out


class RegionPool:
    """Named regions of device memory that sleep and wake as units (see module docstring).

    device: where the regions live ("cuda", "cuda:0", "cpu").
    meter: optional MemoryMeter; its last probe is quoted when a wake does not fit.
    wake_margin_bytes: free memory a wake must leave beyond the region's bytes.
    """

    def __init__(self, device: torch.device | str, *, meter=None,
                 wake_margin_bytes: int = 256 << 20) -> None:
        self.device = with_index(device)
        self.meter = meter
        self.wake_margin_bytes = wake_margin_bytes
        self.arena = PinnedArena(pin=self.device.type == "cuda")
        self._tags: list[str] = []
        self._tracked: dict[str, list] = {}        # tag -> [(tensor, storage)]
        self._tracked_bytes: dict[str, list[int]] = {}
        self._asleep: dict[str, int] = {}          # tag -> level it sleeps at
        self._hooks: dict[str, list] = {}
        self._elastic: dict[str, _Elastic] = {}
        self._backend = _make_backend(self.device)

    # ---- building regions ----------------------------------------------------------------

    def _add_tag(self, tag: str) -> None:
        if not isinstance(tag, str) or not tag:
            raise HandoffError(f"region tag {tag!r} must be a non-empty string, e.g. 'weights'")
        if tag not in self._tags:
            self._tags.append(tag)
            self._tracked[tag] = []
            self._tracked_bytes[tag] = []
            self._hooks[tag] = []

    @contextlib.contextmanager
    def region(self, tag: str):
        """Allocations made inside land in region `tag` (CUDA); on CPU only declares it."""
        self._add_tag(tag)
        if tag in self._asleep:
            raise HandoffError(f"region {tag!r} is asleep: wake_up([{tag!r}]) before "
                               "allocating into it")
        with self._backend.region(tag):
            yield

    def track(self, tag: str, obj) -> None:
        """Register a module's params + buffers (or tensors) as the contents of region `tag`.

        Level 1 keeps exactly the tracked tensors; on CPU they are also what sleep releases.
        On CUDA a tracked tensor must have been allocated inside `region(tag)`.
        """
        self._add_tag(tag)
        if tag in self._asleep:
            raise HandoffError(f"region {tag!r} is asleep: wake it before tracking tensors")
        known = {st._cdata for _, st in self._tracked[tag]}
        for t, storage in _storages(obj):
            if t.device != self.device:
                raise HandoffError(f"track({tag!r}) got a tensor on {t.device}, pool is on "
                                   f"{self.device}: move it or use a pool on that device")
            if storage._cdata in known:
                continue
            self._backend.check_tracked(tag, t)
            known.add(storage._cdata)
            self._tracked[tag].append((t, storage))
            self._tracked_bytes[tag].append(storage.nbytes())

    def elastic(self, tag: str, arena, *, min_per_slab: int, keep_free_bytes: int = 0) -> None:
        """Make `tag` an elastic region over ElasticArena `arena` (awake, mapped as a wake
        maps it): a wake maps at least `min_per_slab` bytes per slab, and every map leaves
        `keep_free_bytes` + wake_margin_bytes free for other allocations."""
        self._add_tag(tag)
        if self._tracked[tag] or tag in self._elastic:
            raise HandoffError(f"region {tag!r} already holds memory: an elastic region is new")
        self._elastic[tag] = _Elastic(arena, min_per_slab, keep_free_bytes)
        self._map_elastic(tag, first=True)

    def grow(self, tag: str) -> int:
        """Elastic `tag`: map what has been freed since (less the margin); returns its
        mapped bytes. Growth below one granule per slab waits for more."""
        e = self._elastic_of(tag)
        if tag in self._asleep:
            return 0
        self._map_elastic(tag, first=False)
        return e.arena.mapped_bytes

    def keep_free(self, tag: str, nbytes: int) -> None:
        """Elastic `tag`: from now on every map leaves `nbytes` (+ the margin) free."""
        self._elastic_of(tag).keep_free_bytes = nbytes

    def _elastic_of(self, tag: str) -> "_Elastic":
        self._check(tag)
        if tag not in self._elastic:
            raise HandoffError(f"region {tag!r} is not elastic: create it with pool.elastic()")
        return self._elastic[tag]

    def _map_elastic(self, tag: str, *, first: bool) -> None:
        e = self._elastic[tag]
        arena = e.arena
        spare = arena.free_bytes() - e.keep_free_bytes - self.wake_margin_bytes
        granules = max(spare, 0) // arena.slabs // arena.granule
        per_slab = arena.mapped_per_slab + granules * arena.granule
        if first and per_slab < e.min_per_slab:
            raise HandoffError(self._oom_message(
                [tag], e.min_per_slab * arena.slabs + e.keep_free_bytes, arena.free_bytes(),
                fix="free memory first (offload trainer state) or lower rollout.max_model_len: "
                    "an elastic pool must hold one sequence"))
        arena.grow_to(per_slab)

    def add_restore_hook(self, tag: str, fn) -> None:
        """Run fn() after every wake of `tag`, after all woken tags are mapped, in order."""
        self._check(tag)
        self._hooks[tag].append(fn)

    # ---- queries -------------------------------------------------------------------------

    @property
    def tags(self) -> list[str]:
        """Known tags in creation order (the default wake order)."""
        return list(self._tags)

    def is_elastic(self, tag: str) -> bool:
        """Mapped by an ElasticArena (outside torch's allocator) rather than torch's."""
        self._check(tag)
        return tag in self._elastic

    def is_awake(self, tag: str) -> bool:
        self._check(tag)
        return tag not in self._asleep

    def region_bytes(self, tag: str) -> int:
        """Device bytes the region holds when awake (what a wake must map)."""
        self._check(tag)
        if tag in self._elastic:
            return self._elastic[tag].arena.mapped_bytes
        return self._backend.region_bytes(tag, sum(self._tracked_bytes[tag]))

    def tracked_bytes(self, tag: str) -> int:
        """Bytes of the tracked tensors' storages (what level 1 copies)."""
        self._check(tag)
        return sum(self._tracked_bytes[tag])

    def _check(self, tag: str) -> None:
        if tag not in self._tags:
            raise HandoffError(f"unknown region tag {tag!r} (known: {self._tags}): create it "
                               "with pool.region(tag) or pool.track(tag, ...)")

    def _resolve(self, tags) -> list[str]:
        if tags is None:
            return list(self._tags)
        if isinstance(tags, str):
            tags = [tags]
        for tag in tags:
            self._check(tag)
        return list(dict.fromkeys(tags))

    # ---- sleep / wake --------------------------------------------------------------------

    def sleep(self, tags=None, *, level: int = 2) -> None:
        """Release the regions' memory; level 1 first copies tracked tensors to the arena."""
        if level not in (1, 2):
            raise HandoffError(f"sleep level={level} is not supported: use 1 (back up "
                               "tracked tensors, then discard) or 2 (discard)")
        todo = [t for t in self._resolve(tags) if t not in self._asleep]
        for tag in [t for t in todo if t in self._elastic]:
            self._elastic[tag].arena.release()   # contents discarded at any level
            self._asleep[tag] = 2
        todo = [t for t in todo if t not in self._elastic]
        if level == 1:
            for tag in todo:
                if not self._tracked[tag] and self.region_bytes(tag) > 0:
                    raise HandoffError(f"level-1 sleep of region {tag!r} would keep nothing: "
                                       f"pool.track({tag!r}, module) its tensors or use level 2")
        self._backend.before_release()
        for tag in todo:
            if level == 1 and self._tracked[tag]:
                name = f"region:{tag}"
                self.arena.stage(name, [t for t, _ in self._tracked[tag]])
                self.arena.offload(name, free_device=False).wait()
            self._backend.release(tag, self._tracked[tag])
            self._asleep[tag] = level

    def wake_up(self, tags=None) -> None:
        """Map the regions again (level 1: restore contents), then run their restore hooks.

        Raises HandoffError before mapping anything if the driver's free memory is below
        the bytes to map plus wake_margin_bytes.
        """
        todo = [t for t in self._resolve(tags) if t in self._asleep]
        if not todo:
            return
        need = sum(self._wake_bytes(t) for t in todo)
        free = self._backend.free_bytes()
        if free < need + self.wake_margin_bytes:
            raise HandoffError(self._oom_message(todo, need, free))
        woken: list[str] = []
        try:
            for tag in todo:
                if tag in self._elastic:
                    self._map_elastic(tag, first=True)
                else:
                    self._backend.remap(tag, self._tracked[tag], self._tracked_bytes[tag])
                woken.append(tag)
                if self._asleep[tag] == 1 and self._tracked[tag]:
                    self.arena.onload(f"region:{tag}").wait()
            for tag in todo:
                for fn in self._hooks[tag]:
                    fn()
        except BaseException:
            # Nothing stays half-awake: put back to sleep what this call mapped (a level-1
            # backup is still intact in the arena).
            self._backend.before_release()
            for tag in woken:
                if tag in self._elastic:
                    self._elastic[tag].arena.release()
                else:
                    self._backend.release(tag, self._tracked[tag])
            raise
        for tag in todo:
            del self._asleep[tag]

    def _wake_bytes(self, tag: str) -> int:
        """What a wake of `tag` must find free: its bytes, or an elastic tag's minimum."""
        if tag in self._elastic:
            e = self._elastic[tag]
            return e.min_per_slab * e.arena.slabs + e.keep_free_bytes
        return self.region_bytes(tag)

    def _oom_message(self, tags: list[str], need: int, free: int, fix: str = (
            "free memory first (aggressive_empty_cache(), offload trainer state) or lower "
            "rollout.gpu_memory_utilization")) -> str:
        holders = "no meter probe yet (pass meter= to RegionPool to see who holds it)"
        last = self.meter.last if self.meter is not None else None
        if last:
            from handoff.memory.meter import owners

            held = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in owners(last).items()
                             if k != "free" and v > 0)
            holders = (f"at probe {last['name']!r}: {held or 'nothing measured'} (torch "
                       f"allocated {fmt_bytes(last['allocated'])})")
        return (f"cannot wake {tags}: needs {fmt_bytes(need)} + margin "
                f"{fmt_bytes(self.wake_margin_bytes)} but the driver has {fmt_bytes(free)} free; "
                f"{holders}; {fix}")


@dataclass
class _Elastic:
    arena: object           # memory.elastic.ElasticArena
    min_per_slab: int
    keep_free_bytes: int


def _make_backend(device: torch.device):
    if device.type == "cuda":
        from handoff.memory.tms_backend import TmsBackend

        return TmsBackend(device)
    if device.type == "cpu":
        return _CpuBackend()
    raise HandoffError(f"RegionPool does not support device {device}: use 'cuda' or 'cpu'")


class _CpuBackend:
    """CPU: a region is its tracked tensors; release = storages shrink to zero bytes."""

    @contextlib.contextmanager
    def region(self, tag: str):
        yield

    def check_tracked(self, tag: str, t: torch.Tensor) -> None:
        pass

    def region_bytes(self, tag: str, tracked_bytes: int) -> int:
        return tracked_bytes

    def free_bytes(self) -> int:
        """MemAvailable (what the kernel could still hand out); no /proc: never refuse."""
        return host_memory()[1] or 1 << 62

    def before_release(self) -> None:
        pass

    def release(self, tag: str, tracked: list) -> None:
        for _, storage in tracked:
            storage.resize_(0)

    def remap(self, tag: str, tracked: list, nbytes: list[int]) -> None:
        try:
            for (_, storage), n in zip(tracked, nbytes):
                storage.resize_(n)
        except BaseException:
            self.release(tag, tracked)  # all or nothing, like a CUDA remap
            raise
