"""The CUDA backend of RegionPool: torch_memory_saver 0.0.10 in `torch` hook mode.

Each tag is a torch.cuda.MemPool whose segments torch_memory_saver creates with
cuMemCreate + cuMemMap; pause unmaps and releases the physical pages of every segment of
the tag, resume maps fresh pages at the same virtual addresses. Things it does that shape
this file:
* it aborts the process when asked to pause a paused tag or resume an awake one, and when
  a resume runs out of memory half way: RegionPool keeps the state and checks the driver's
  free memory before every wake, so neither reaches it;
* it refuses to start when PYTORCH_CUDA_ALLOC_CONF sets expandable_segments: we hide that
  setting from its start-up check; and PyTorch refuses MemPool allocations while the
  setting is on, so a region switches it off while it allocates and back afterwards (the
  rest of the process keeps it; switch it only through handoff.memory so the two agree);
* pause does not wait for running kernels, so we synchronize first;
* its tags are process-wide and its pools live until the process ends: each RegionPool
  prefixes its tags (`handoff3:weights`) so two pools never pause each other's memory or
  hand out each other's (possibly unmapped) cached blocks;
* it ends the process with status 1 ("only support interesting region") when PyTorch frees
  a segment of its pools outside a region(): `handoff bench engine` and a pytest session of
  the engine's CUDA tests printed that at exit and ended with status 1 after succeeding. An
  exit hook marks the rest of the process as inside a region, so such frees go through it
  (a small program that frees region memory before exiting did not reproduce the failure).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os

import torch

from handoff.errors import HandoffError
from handoff.memory.allocator import expandable_segments

_POOL_IDS = itertools.count()


def _saver():
    """The process-wide torch_memory_saver, started in torch hook mode."""
    try:
        import torch_memory_saver
    except ImportError as e:
        raise HandoffError("torch_memory_saver is not installed: pip install "
                           "torch_memory_saver==0.0.10 (on a machine without network, "
                           "scripts/device-env.sh installs a carried wheel)") from e
    saver = torch_memory_saver.torch_memory_saver
    if saver._impl is None:
        saver.hook_mode = "torch"
        conf_key = "PYTORCH_CUDA_ALLOC_CONF"
        conf = os.environ.get(conf_key)
        if conf is not None:
            # Its start-up check reads only this variable; PyTorch read it long ago.
            kept = [p for p in conf.split(",") if not p.strip().lower().startswith(
                "expandable_segments")]
            os.environ[conf_key] = ",".join(kept)
        try:
            saver._ensure_initialized()
        finally:
            if conf is not None:
                os.environ[conf_key] = conf
        atexit.register(saver._impl._binary_wrapper.cdll.tms_set_interesting_region, True)
    elif getattr(saver._impl, "_hook_mode", "torch") != "torch":
        raise HandoffError("torch_memory_saver was started in preload mode by another part of "
                           "this process: start it in torch mode (let RegionPool start it)")
    return saver


def _pool_segments(pool, device_index: int) -> list[dict]:
    try:
        snap = pool.snapshot(include_traces=False)
    except TypeError:  # older torch: no include_traces
        snap = pool.snapshot()
    segments = snap["segments"] if isinstance(snap, dict) else snap
    pool_id = tuple(pool.id)
    return [s for s in segments if s.get("device", device_index) == device_index
            and tuple(s.get("segment_pool_id", pool_id)) == pool_id]


class TmsBackend:
    """RegionPool's CUDA backend (see module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.saver = _saver()
        self._prefix = f"handoff{next(_POOL_IDS)}:"
        self._reserved_delta: dict[str, int] = {}
        self._bytes_cache: dict[str, int] = {}   # segments change only inside region()

    @contextlib.contextmanager
    def region(self, tag: str):
        before = torch.cuda.memory_reserved(self.device)
        # PyTorch refuses MemPool allocations while expandable_segments is on.
        with torch.cuda.device(self.device), expandable_segments(False), \
                self.saver.region(tag=self._prefix + tag):
            try:
                yield
            finally:
                self._bytes_cache.pop(tag, None)
                grown = torch.cuda.memory_reserved(self.device) - before
                self._reserved_delta[tag] = self._reserved_delta.get(tag, 0) + max(grown, 0)

    def _segments(self, tag: str) -> list[dict] | None:
        pools = getattr(self.saver._impl, "_mem_pools", None)
        if pools is None:
            return None
        out = []
        for key, pool in list(pools.items()):
            if key[0] == self._prefix + tag:
                out += _pool_segments(pool, self.device.index)
        return out

    def region_bytes(self, tag: str, tracked_bytes: int) -> int:
        if tag not in self._bytes_cache:
            segments = self._segments(tag)
            if segments is None:
                return max(self._reserved_delta.get(tag, 0), tracked_bytes)
            self._bytes_cache[tag] = sum(s["total_size"] for s in segments)
        return self._bytes_cache[tag]

    def check_tracked(self, tag: str, t: torch.Tensor) -> None:
        segments = self._segments(tag)
        if segments is None or t.untyped_storage().nbytes() == 0:
            return
        ptr = t.untyped_storage().data_ptr()
        if not any(s["address"] <= ptr < s["address"] + s["total_size"] for s in segments):
            raise HandoffError(f"a tensor of shape {tuple(t.shape)} tracked under {tag!r} was "
                               f"not allocated inside pool.region({tag!r}): create it there so "
                               "sleep can release it")

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def before_release(self) -> None:
        torch.cuda.synchronize(self.device)

    def release(self, tag: str, tracked: list) -> None:
        self.saver.pause(self._prefix + tag)

    def remap(self, tag: str, tracked: list, nbytes: list[int]) -> None:
        self.saver.resume(self._prefix + tag)
