"""Page drivers for :class:`kvrt.memory.elastic.ElasticPool`: the CUDA virtual memory API, and a host stand-in.

The pool's policy (who holds which page, what is charged, when a page may move) lives
in :mod:`kvrt.memory.elastic` and never calls CUDA itself; it talks to a :class:`PageDriver`.
:class:`CudaDriver` is that driver over ``cuda.bindings.driver`` (cuMemAddressReserve,
cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease); :class:`HostDriver`
keeps the same contract in host memory and *enforces* it (no double map, no unmap of
an unmapped page, no release of a mapped page, no free of a range that still has
pages), so the CPU tests of the policy exercise the rules the GPU would crash on.

Fences: a page leaves a tenant's range only after the work that last read it has
finished. The pool is handed a :class:`Fence` (an event recorded after that work) and
unmaps once ``done()``; drivers make one with :meth:`PageDriver.fence`.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvrt.errors import KvrtError

DEFAULT_PAGE_BYTES = 2 << 20  # the VMM allocation granularity on the H200


class VmmError(KvrtError):
    """A virtual-memory call failed or broke the page contract.

    ``call`` names the driver function, ``code`` the CUDA error name when there is one.
    """

    def __init__(self, call: str, message: str, *, code: str | None = None) -> None:
        self.call = call
        self.code = code
        super().__init__(f"{call}{f' ({code})' if code else ''}: {message}")


class DeviceOutOfMemory(VmmError):
    """The device had no memory for another physical page (a refusal, not a crash)."""


class Fence(Protocol):
    """Completion of the work that last used a range: ``done()`` polls, ``wait()`` blocks."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class PageDriver(Protocol):
    """What :class:`kvrt.memory.elastic.ElasticPool` needs from a memory backend.

    Addresses are plain ints; a page is ``page_bytes`` long and every address handed to
    ``map_page``/``unmap_page``/``set_access`` is page aligned.
    """

    page_bytes: int

    def reserve(self, nbytes: int) -> int: ...

    def free_reservation(self, va: int, nbytes: int) -> None: ...

    def create_page(self) -> Any: ...

    def release_page(self, handle: Any) -> None: ...

    def map_page(self, va: int, handle: Any) -> None: ...

    def set_access(self, va: int, nbytes: int) -> None: ...

    def unmap_page(self, va: int) -> None: ...

    def array(self, va: int, shape: tuple[int, ...], dtype: Any, owner: object) -> Any: ...

    def fence(self, stream: Any = None) -> Fence: ...

    def synchronize(self) -> None: ...


# -- host stand-in ----------------------------------------------------------------------


class DoneFence:
    """A fence for work that is already complete (host work is synchronous)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


_POISON = 0xFF  # fp16 0xFFFF is a NaN: a kernel reading an unmapped page gets NaNs, not stale data


@dataclass
class _HostRange:
    va: int
    data: np.ndarray
    mapped: dict[int, int] = field(default_factory=dict)  # page index -> handle


class HostDriver:
    """The page contract in host memory, checked on every call.

    A reserved range is a zero-initialised host array (the OS commits it lazily). Mapping
    records which page backs which address; unmapping poisons the bytes so a reader of a
    range it no longer owns sees NaNs. ``capacity_pages`` limits how many physical pages
    may exist at once, so tests can drive the out-of-memory path. ``poison=False`` skips
    the poisoning, for long traces that never read the KV (it would commit host memory
    for every page ever unmapped).
    """

    def __init__(self, page_bytes: int = DEFAULT_PAGE_BYTES, *, capacity_pages: int | None = None,
                 poison: bool = True) -> None:
        if page_bytes <= 0 or page_bytes % 256:
            raise VmmError("HostDriver", f"page_bytes must be a positive multiple of 256, got {page_bytes}")
        self.page_bytes = page_bytes
        self.capacity_pages = capacity_pages
        self.poison = poison
        self._lock = threading.Lock()
        self._ranges: dict[int, _HostRange] = {}
        self._pages: dict[int, int | None] = {}  # handle -> va it is mapped at, or None
        self._handles = itertools.count(1)
        self._next_va = 1 << 40

    # what the tests inspect
    @property
    def live_pages(self) -> int:
        return len(self._pages)

    @property
    def mapped_pages(self) -> int:
        return sum(1 for va in self._pages.values() if va is not None)

    @property
    def live_ranges(self) -> int:
        return len(self._ranges)

    def _locate(self, va: int, nbytes: int, call: str) -> tuple[_HostRange, int]:
        for rng in self._ranges.values():
            if rng.va <= va and va + nbytes <= rng.va + rng.data.size:
                return rng, va - rng.va
        raise VmmError(call, f"[{va:#x}, {va + nbytes:#x}) is not inside any reserved range")

    def reserve(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.page_bytes:
            raise VmmError("reserve", f"size {nbytes} is not a positive multiple of the page size {self.page_bytes}")
        with self._lock:
            va = self._next_va
            self._next_va += nbytes + self.page_bytes  # a guard page between ranges
            self._ranges[va] = _HostRange(va, np.zeros(nbytes, dtype=np.uint8))
            return va

    def free_reservation(self, va: int, nbytes: int) -> None:
        with self._lock:
            rng = self._ranges.get(va)
            if rng is None or rng.data.size != nbytes:
                raise VmmError("free_reservation", f"no range of {nbytes} B was reserved at {va:#x}")
            if rng.mapped:
                raise VmmError("free_reservation", f"range {va:#x} still has {len(rng.mapped)} mapped pages")
            del self._ranges[va]

    def create_page(self) -> int:
        with self._lock:
            if self.capacity_pages is not None and len(self._pages) >= self.capacity_pages:
                raise DeviceOutOfMemory("create_page", f"all {self.capacity_pages} pages exist",
                                        code="CUDA_ERROR_OUT_OF_MEMORY")
            handle = next(self._handles)
            self._pages[handle] = None
            return handle

    def release_page(self, handle: int) -> None:
        with self._lock:
            if handle not in self._pages:
                raise VmmError("release_page", f"page {handle} does not exist")
            if self._pages[handle] is not None:
                raise VmmError("release_page", f"page {handle} is still mapped at {self._pages[handle]:#x}")
            del self._pages[handle]

    def map_page(self, va: int, handle: int) -> None:
        with self._lock:
            rng, offset = self._locate(va, self.page_bytes, "map_page")
            if offset % self.page_bytes:
                raise VmmError("map_page", f"address {va:#x} is not page aligned")
            if handle not in self._pages:
                raise VmmError("map_page", f"page {handle} does not exist")
            if self._pages[handle] is not None:
                raise VmmError("map_page", f"page {handle} is already mapped at {self._pages[handle]:#x}")
            index = offset // self.page_bytes
            if index in rng.mapped:
                raise VmmError("map_page", f"address {va:#x} already has page {rng.mapped[index]} mapped")
            rng.mapped[index] = handle
            self._pages[handle] = va

    def set_access(self, va: int, nbytes: int) -> None:
        with self._lock:
            rng, offset = self._locate(va, nbytes, "set_access")
            for index in range(offset // self.page_bytes, (offset + nbytes) // self.page_bytes):
                if index not in rng.mapped:
                    raise VmmError("set_access", f"page at {rng.va + index * self.page_bytes:#x} is not mapped")

    def unmap_page(self, va: int) -> None:
        with self._lock:
            rng, offset = self._locate(va, self.page_bytes, "unmap_page")
            handle = rng.mapped.pop(offset // self.page_bytes, None)
            if handle is None:
                raise VmmError("unmap_page", f"nothing is mapped at {va:#x}")
            self._pages[handle] = None
            if self.poison:
                rng.data[offset:offset + self.page_bytes] = _POISON

    def array(self, va: int, shape: tuple[int, ...], dtype: Any, owner: object) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        rng, offset = self._locate(va, nbytes, "array")
        array: np.ndarray = rng.data[offset:offset + nbytes].view(dt).reshape(shape)
        return array

    def fence(self, stream: Any = None) -> Fence:
        return DoneFence()

    def synchronize(self) -> None:
        return None


# -- CUDA -------------------------------------------------------------------------------


class CudaEventFence:
    """A CUDA event recorded on a stream after the last work that reads a range."""

    def __init__(self, stream: Any = None) -> None:
        import cupy

        self._event = cupy.cuda.Event(block=False, disable_timing=True)
        self._event.record(stream if stream is not None else cupy.cuda.get_current_stream())

    def done(self) -> bool:
        return bool(self._event.done)

    def wait(self) -> None:
        self._event.synchronize()


class CudaDriver:
    """CUDA VMM through ``cuda.bindings.driver`` on one device.

    Every call's ``CUresult`` is checked; ``CUDA_ERROR_OUT_OF_MEMORY`` from ``cuMemCreate``
    becomes :class:`DeviceOutOfMemory` so the pool can refuse instead of crashing. The
    device's primary context is retained (the one CuPy and Numba use) and made current
    on whichever thread calls in (the pool's filler runs on its own thread).
    """

    def __init__(self, device: int = 0) -> None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as exc:
            raise VmmError("CudaDriver", "cuda.bindings is not importable (install kvrt[cuda]); "
                           "on a machine without a GPU use kvrt.memory.vmm.HostDriver") from exc

        self._cu = cu
        self.device = device
        self._check(cu.cuInit(0), "cuInit")
        dev = self._check(cu.cuDeviceGet(device), "cuDeviceGet")
        self._context = self._check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._dev = dev
        self._local = threading.local()
        self._make_current()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.page_bytes = int(self._check(
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity"))

    def _check(self, result: tuple[Any, ...], call: str) -> Any:
        """Unpack a cuda-bindings ``(CUresult, *values)`` tuple or raise naming the call."""
        cu = self._cu
        err, values = result[0], result[1:]
        if err != cu.CUresult.CUDA_SUCCESS:
            name_err, name = cu.cuGetErrorName(err)
            code = name.decode() if name_err == cu.CUresult.CUDA_SUCCESS and name else str(err)
            cls = DeviceOutOfMemory if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY else VmmError
            raise cls(call, "the CUDA driver refused the call", code=code)
        if not values:
            return None
        return values[0] if len(values) == 1 else values

    def _make_current(self) -> None:
        if getattr(self._local, "current", False):
            return
        self._check(self._cu.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        self._local.current = True

    def _ptr(self, va: int) -> Any:
        return self._cu.CUdeviceptr(va)

    def reserve(self, nbytes: int) -> int:
        self._make_current()
        va = self._check(self._cu.cuMemAddressReserve(nbytes, self.page_bytes, 0, 0), "cuMemAddressReserve")
        return int(va)

    def free_reservation(self, va: int, nbytes: int) -> None:
        self._make_current()
        self._check(self._cu.cuMemAddressFree(self._ptr(va), nbytes), "cuMemAddressFree")

    def create_page(self) -> Any:
        self._make_current()
        return self._check(self._cu.cuMemCreate(self.page_bytes, self._prop, 0), "cuMemCreate")

    def release_page(self, handle: Any) -> None:
        self._make_current()
        self._check(self._cu.cuMemRelease(handle), "cuMemRelease")

    def map_page(self, va: int, handle: Any) -> None:
        self._make_current()
        self._check(self._cu.cuMemMap(self._ptr(va), self.page_bytes, 0, handle, 0), "cuMemMap")

    def set_access(self, va: int, nbytes: int) -> None:
        self._make_current()
        self._check(self._cu.cuMemSetAccess(self._ptr(va), nbytes, [self._access], 1), "cuMemSetAccess")

    def unmap_page(self, va: int) -> None:
        self._make_current()
        self._check(self._cu.cuMemUnmap(self._ptr(va), self.page_bytes), "cuMemUnmap")

    def array(self, va: int, shape: tuple[int, ...], dtype: Any, owner: object) -> Any:
        """A CuPy array over ``[va, va + size)``; ``owner`` is kept alive by the array."""
        import cupy

        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        memory = cupy.cuda.UnownedMemory(va, nbytes, owner, self.device)
        return cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(memory, 0))

    def fence(self, stream: Any = None) -> Fence:
        return CudaEventFence(stream)

    def synchronize(self) -> None:
        self._make_current()
        self._check(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")
