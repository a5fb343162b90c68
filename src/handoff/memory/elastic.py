"""An elastic region: one reserved virtual range, backed by memory from the front of each of
its slabs, grown while in use and unmapped whole at sleep (rollout.kv_pool=elastic).

    arena = ElasticArena("cuda", slabs=2 * layers, slab_bytes=max_blocks * block_bytes)
    kv = arena.view(torch.bfloat16, (2, layers, max_blocks, 16, heads, dim))  # fixed addresses
    arena.grow_to(n * block_bytes)      # the first n blocks of every slab are memory now
    arena.release()                     # all of it back to the driver; addresses kept

A slab is one layer's K (or V): growing maps the next granules of every slab, so block i of
every layer is backed once any slab's front reaches it, and the paged kernels keep their
per-layer layout (and speed). Addresses never change, so CUDA graphs captured over the view
stay valid across release and growth.

Backends:
* CUDA: the driver's virtual memory API through NVIDIA's `cuda-bindings` (cuMemAddressReserve
  once; per growth cuMemCreate + cuMemMap + cuMemSetAccess per slab piece; cuMemUnmap +
  cuMemRelease at release). torch_memory_saver maps a whole allocation at once, and torch's
  allocator cannot map part of a tensor, hence the driver directly; cuda-bindings is the
  driver's own maintained binding (no ctypes prototypes of ours to get wrong).
* CPU (and tests): the same bookkeeping over an ordinary tensor of the full size, with a
  simulated device (`SimulatedDevice`: a capacity, and bytes "other owners" hold) so that
  free memory, growth and a wake that cannot fit are exercised without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from handoff.dist import with_index
from handoff.errors import HandoffError
from handoff.units import fmt_bytes


@dataclass
class SimulatedDevice:
    """CPU stand-in for a card: `capacity` bytes, of which `others` are held by other owners."""

    capacity: int
    others: int = 0
    granule: int = 4096


class ElasticArena:
    """`slabs` equal slabs of `slab_bytes` each, mapped from their fronts (module docstring)."""

    def __init__(self, device: torch.device | str, *, slabs: int, slab_bytes: int,
                 simulated: SimulatedDevice | None = None) -> None:
        self.device = with_index(device)
        if self.device.type == "cuda":
            self._backend = _VmmBackend(self.device)
        elif self.device.type == "cpu":
            self._backend = _SimulatedBackend(simulated or SimulatedDevice(capacity=1 << 62))
        else:
            raise HandoffError(f"an elastic region needs 'cuda' or 'cpu', not {self.device}")
        self.granule = self._backend.granule
        if slab_bytes <= 0 or slab_bytes % self.granule:
            raise HandoffError(f"slab_bytes={slab_bytes} must be a positive multiple of the "
                               f"{self.granule}-byte granule: round it up to "
                               "ElasticArena.granule_bytes(device)")
        self.slabs, self.slab_bytes = slabs, slab_bytes
        self._backend.reserve(slabs * slab_bytes)
        self._base: torch.Tensor | None = None
        self.mapped_per_slab = 0

    @staticmethod
    def granule_bytes(device: torch.device | str, simulated: SimulatedDevice | None = None) -> int:
        """The mapping granule on `device` (CUDA: the driver's minimum; CPU: the simulation's)."""
        device = with_index(device)
        if device.type == "cuda":
            return _VmmBackend.granule_of(device)
        return (simulated or SimulatedDevice(capacity=1 << 62)).granule

    @property
    def capacity_bytes(self) -> int:
        return self.slabs * self.slab_bytes

    @property
    def mapped_bytes(self) -> int:
        return self.slabs * self.mapped_per_slab

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole reserved range as one tensor (only the mapped fronts may be touched).
        Made once something is mapped: torch asks the driver whose memory the address is."""
        if self._base is None:
            if not self.mapped_per_slab:
                raise HandoffError("view() of an elastic region with nothing mapped: grow_to first")
            self._base = self._backend.tensor(self.capacity_bytes)
        elem = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * elem != self.capacity_bytes:
            raise HandoffError(f"view {shape} of {dtype} is not the arena's "
                               f"{self.capacity_bytes} bytes")
        return self._base.view(dtype).view(shape)

    def free_bytes(self) -> int:
        """What the device has free now (the driver's count; CPU: the simulation's)."""
        return self._backend.free_bytes()

    def grow_to(self, per_slab: int) -> int:
        """Map every slab's front up to `per_slab` bytes (rounded up to the granule, capped at
        the slab); returns the bytes mapped per slab. Never shrinks."""
        target = min(-(-per_slab // self.granule) * self.granule, self.slab_bytes)
        if target <= self.mapped_per_slab:
            return self.mapped_per_slab
        size = target - self.mapped_per_slab
        need = size * self.slabs
        free = self.free_bytes()
        if need > free:
            raise HandoffError(f"cannot map {fmt_bytes(need)} more of the elastic pool: the "
                               f"device has {fmt_bytes(free)} free")
        done = []
        try:
            for slab in range(self.slabs):
                offset = slab * self.slab_bytes + self.mapped_per_slab
                self._backend.map(offset, size)
                done.append(offset)
        except BaseException:
            for offset in done:   # all slabs or none: the slabs' fronts stay equal
                self._backend.unmap(offset)
            raise
        self.mapped_per_slab = target
        return target

    def release(self) -> None:
        """Unmap every slab's front: all its memory back to the device, addresses kept."""
        self._backend.unmap_all()
        self.mapped_per_slab = 0

    def close(self) -> None:
        """Release, then give the virtual range back (the view must not be used after)."""
        self.release()
        self._backend.close()


class _SimulatedBackend:
    """A host tensor of the whole range; mapping only counts against the SimulatedDevice."""

    def __init__(self, sim: SimulatedDevice) -> None:
        self.sim = sim
        self.granule = sim.granule
        self._mapped: dict[int, int] = {}   # offset -> size

    def reserve(self, nbytes: int) -> None:
        self._host = torch.zeros(nbytes, dtype=torch.uint8)

    def tensor(self, nbytes: int) -> torch.Tensor:
        return self._host

    def free_bytes(self) -> int:
        return max(self.sim.capacity - self.sim.others - sum(self._mapped.values()), 0)

    def map(self, offset: int, size: int) -> None:
        if size > self.free_bytes():
            raise HandoffError(f"simulated device out of memory mapping {fmt_bytes(size)}")
        self._mapped[offset] = size

    def unmap(self, offset: int) -> None:
        del self._mapped[offset]

    def unmap_all(self) -> None:
        self._mapped.clear()

    def close(self) -> None:
        pass


class _VmmBackend:
    """The CUDA driver's virtual memory management, on the current torch device's context."""

    def __init__(self, device: torch.device) -> None:
        self.cu = _driver()
        self.device = device
        torch.cuda.init()
        torch.cuda.set_device(device)
        # torch runs on the device's primary context; the driver calls must too.
        _check(self.cu.cuCtxSetCurrent(_check(self.cu.cuDevicePrimaryCtxRetain(device.index))))
        self.prop = self._prop(device.index)
        self.granule = self.granule_of(device)
        self.access = self.cu.CUmemAccessDesc()
        self.access.location = self.prop.location
        self.access.flags = self.cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._mapped: dict[int, tuple[int, object]] = {}   # offset -> (size, handle)
        self._ptr = 0
        self._reserved = 0

    @classmethod
    def _prop(cls, index: int):
        driver = _driver()
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        return prop

    @classmethod
    def granule_of(cls, device: torch.device) -> int:
        driver = _driver()
        flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(_check(driver.cuMemGetAllocationGranularity(cls._prop(device.index), flag)))

    def reserve(self, nbytes: int) -> None:
        self._ptr = int(_check(self.cu.cuMemAddressReserve(nbytes, self.granule, 0, 0)))
        self._reserved = nbytes

    def tensor(self, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_CudaRange(self._ptr, nbytes), device=self.device)

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def map(self, offset: int, size: int) -> None:
        cu = self.cu
        handle = _check(cu.cuMemCreate(size, self.prop, 0))
        address = cu.CUdeviceptr(self._ptr + offset)
        try:
            _check(cu.cuMemMap(address, size, 0, handle, 0))
        except BaseException:
            _check(cu.cuMemRelease(handle))
            raise
        self._mapped[offset] = (size, handle)
        _check(cu.cuMemSetAccess(address, size, [self.access], 1))

    def unmap(self, offset: int) -> None:
        size, handle = self._mapped.pop(offset)
        _check(self.cu.cuMemUnmap(self.cu.CUdeviceptr(self._ptr + offset), size))
        _check(self.cu.cuMemRelease(handle))

    def unmap_all(self) -> None:
        if self._mapped:
            torch.cuda.synchronize(self.device)   # no kernel may still read what goes away
        for offset in list(self._mapped):
            self.unmap(offset)

    def close(self) -> None:
        if self._reserved:
            _check(self.cu.cuMemAddressFree(self.cu.CUdeviceptr(self._ptr), self._reserved))
            self._reserved = 0


class _CudaRange:
    """A reserved device range as bytes, for torch.as_tensor (no copy, no ownership)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


def _driver():
    """NVIDIA's driver binding, or the error that names its install."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise HandoffError("rollout.kv_pool=elastic maps memory through NVIDIA's "
                           "cuda-bindings, which is not installed: pip install "
                           "'handoff[elastic]' (cuda-bindings of your CUDA major version), "
                           "or use rollout.kv_pool=fixed") from None
    return driver


def _check(result):
    """cuda-bindings returns (error, *values): raise on an error, return the value(s)."""
    err, *values = result
    if int(err) != 0:
        _, name = _driver().cuGetErrorName(err)
        raise HandoffError(f"CUDA driver call failed: {name.decode() if name else int(err)}")
    return values[0] if len(values) == 1 else (values or None)
