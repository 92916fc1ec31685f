"""Reusable host buffers for KV state: pinned through CuPy on a GPU machine, page-aligned elsewhere.

Why a pool: a 3.5k-token state of a 7B model is ~200 MB and pinning memory costs far
more than copying into it, so a snapshot must not allocate (or pin) per capture.
Buffers are grouped in size classes (eight per power of two, so at most 12.5% is
wasted) and a released buffer is handed to the next request of its class.

Why pinned: host<->device copies from page-locked memory run several times faster than
from pageable memory (figures in bench/RESULTS.md). CuPy is imported only when pinning
is asked for or detected, never on a CPU-only path.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrt.checks import check_int
from kvrt.errors import KvrtError
from kvrt.system.gpu import cupy_usable, nvidia_gpu_count

PAGE = 4096
_CLASSES_PER_OCTAVE = 8


class HostPoolError(KvrtError):
    """A buffer request the pool cannot serve (bad size, over its byte limit, pinning unavailable)."""


def size_class(nbytes: int) -> int:
    """The capacity a request of ``nbytes`` is served with (page multiple, <= 12.5% slack)."""
    nbytes = check_int(nbytes, "a host buffer's size", noun="an integer byte count", error=HostPoolError)
    if nbytes <= 0:
        raise HostPoolError(f"a host buffer needs a positive size, got {nbytes} bytes")
    pages = -(-nbytes // PAGE)
    if pages <= _CLASSES_PER_OCTAVE:
        return pages * PAGE
    step = 1 << (pages.bit_length() - 1 - 3)  # an eighth of the octave
    return -(-pages // step) * step * PAGE


def _optional_size(value: object, what: str) -> int | None:
    return None if value is None else check_int(value, what, low=0, noun="an integer byte count", error=HostPoolError)


_pageable_warned = threading.Event()


def _warn_pageable_on_gpu_machine() -> None:
    """Say once, loudly, that a GPU machine's pool is pageable: swaps then run at a fraction of PCIe speed."""
    if _pageable_warned.is_set() or not nvidia_gpu_count():
        return
    _pageable_warned.set()
    warnings.warn("an NVIDIA GPU is visible but CuPy is missing or sees no device: host pools fall back to pageable "
                  "memory (about 7x slower host<->device copies on an H200); install kvrt's 'cuda' extra",
                  RuntimeWarning, stacklevel=3)


def _alloc_pinned(capacity: int) -> tuple[np.ndarray, Any]:
    """Page-locked memory of its own (``cudaHostAlloc``), freed when the owner goes: not CuPy's
    ``alloc_pinned_memory``, whose pool would keep every block it ever served after this pool let it go."""
    import cupy  # noqa: PLC0415

    memory = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(capacity), 0)
    return np.frombuffer(memory, dtype=np.uint8, count=capacity), memory


def _alloc_aligned(capacity: int) -> tuple[np.ndarray, Any]:
    raw = np.empty(capacity + PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % PAGE
    return raw[offset:offset + capacity], raw


class HostBuffer:
    """A leased host buffer: :attr:`view` is exactly ``nbytes`` long and writable.

    Return it with :meth:`release` or a ``with`` block (releasing twice is harmless);
    using :attr:`view` afterwards raises, because the memory may already belong to
    someone else. A buffer dropped unreleased goes back to its pool when it is
    collected, or at interpreter exit (``weakref.finalize``).

    Invariant: giving the block back only appends it to the pool's return queue, which
    never blocks, so a finalizer run by a collection on a thread that holds the pool's
    lock cannot deadlock; the pool settles the queue under its lock on its next call.
    """

    __slots__ = ("_block", "nbytes", "_finalizer", "__weakref__")

    def __init__(self, returns: deque[_Block], block: _Block, nbytes: int) -> None:
        self._block = block
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, returns.append, block)

    @property
    def view(self) -> np.ndarray:
        if not self._finalizer.alive:
            raise HostPoolError("this host buffer was released back to its pool")
        return self._block.array[:self.nbytes]

    @property
    def pinned(self) -> bool:
        return self._block.pinned

    @property
    def capacity(self) -> int:
        return self._block.capacity

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Give the buffer back to its pool (at most once, whoever calls first)."""
        self._finalizer()

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"HostBuffer({self.nbytes} bytes, {'pinned' if self.pinned else 'pageable'})"


@dataclass
class _Block:
    array: np.ndarray
    owner: Any  # keeps the allocation alive (CuPy PinnedMemoryPointer or the unaligned ndarray)
    capacity: int
    pinned: bool


@dataclass(frozen=True)
class HostPoolStats:
    allocations: int
    reuses: int
    bytes_in_use: int
    bytes_cached: int
    pinned: bool


class HostPool:
    """Thread-safe pool of host buffers, reused by size class.

    ``pinned``: ``True`` requires CuPy with a GPU, ``False`` never pins, ``None`` pins
    when CuPy sees a GPU. ``max_cached_bytes`` bounds the memory kept for reuse after
    release (in-use memory is never reclaimed under a caller); ``max_bytes`` bounds
    in-use plus cached memory and refuses a request that would pass it.
    """

    def __init__(self, *, pinned: bool | None = None, max_cached_bytes: int | None = None,
                 max_bytes: int | None = None) -> None:
        available = cupy_usable() if pinned is not False else False
        if pinned and not available:
            raise HostPoolError("pinned host memory needs CuPy and a CUDA GPU; neither is usable here")
        if pinned is None and not available:
            _warn_pageable_on_gpu_machine()
        self.pinned = bool(available)
        self.max_cached_bytes = _optional_size(max_cached_bytes, "max_cached_bytes")
        self.max_bytes = _optional_size(max_bytes, "max_bytes")
        self._free: dict[int, list[_Block]] = {}
        self._returned: deque[_Block] = deque()  # released blocks not yet back in the books (see HostBuffer)
        self._lock = threading.Lock()
        self._allocations = 0
        self._reuses = 0
        self._in_use = 0
        self._cached = 0

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes`` (its view exactly ``nbytes``), reused when one is free."""
        capacity = size_class(nbytes)
        with self._lock:
            self._settle_returns()
            free = self._free.get(capacity)
            if free:
                block = free.pop()
                self._cached -= capacity
                self._reuses += 1
                self._in_use += capacity
                return HostBuffer(self._returned, block, nbytes)
            if self.max_bytes is not None and self._in_use + self._cached + capacity > self.max_bytes:
                self._trim(self._in_use + capacity)
                if self._in_use + self._cached + capacity > self.max_bytes:
                    raise HostPoolError(
                        f"host pool limit: {self._in_use} bytes in use + {capacity} requested "
                        f"(for {nbytes}) exceeds max_bytes={self.max_bytes}")
            self._in_use += capacity
            self._allocations += 1
        try:
            array, owner = (_alloc_pinned if self.pinned else _alloc_aligned)(capacity)
        except Exception as exc:
            with self._lock:
                self._in_use -= capacity
            raise HostPoolError(f"could not allocate {capacity} bytes of "
                                f"{'pinned' if self.pinned else 'pageable'} host memory: {exc}") from exc
        return HostBuffer(self._returned, _Block(array, owner, capacity, self.pinned), nbytes)

    def _settle_returns(self) -> None:
        """Move every released block from the return queue into the cache (lock held)."""
        returned = False
        while self._returned:
            block = self._returned.popleft()
            self._in_use -= block.capacity
            self._free.setdefault(block.capacity, []).append(block)
            self._cached += block.capacity
            returned = True
        if returned and self.max_cached_bytes is not None:
            self._trim_cache_to(self.max_cached_bytes)

    def _trim(self, keep_in_use: int) -> None:
        """Drop cached blocks until in-use + cached fits ``max_bytes`` (lock held)."""
        assert self.max_bytes is not None
        self._trim_cache_to(max(self.max_bytes - keep_in_use, 0))

    def _trim_cache_to(self, limit: int) -> None:
        for capacity in sorted(self._free, reverse=True):
            blocks = self._free[capacity]
            while blocks and self._cached > limit:
                blocks.pop()
                self._cached -= capacity
            if not blocks:
                del self._free[capacity]

    def clear(self) -> None:
        """Free every cached buffer (leased ones stay valid)."""
        with self._lock:
            self._settle_returns()
            self._trim_cache_to(0)

    @property
    def stats(self) -> HostPoolStats:
        with self._lock:
            self._settle_returns()
            return HostPoolStats(self._allocations, self._reuses, self._in_use, self._cached, self.pinned)


def host_memory(nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory for a long-lived arena (a host tier's): pinned when CuPy sees a GPU, else
    page-aligned NumPy memory. The array keeps its memory alive (its base is the owner)."""
    pinned = cupy_usable()
    if not pinned:
        _warn_pageable_on_gpu_machine()
    try:
        array, _owner = (_alloc_pinned if pinned else _alloc_aligned)(nbytes)
    except Exception as exc:
        raise HostPoolError(f"could not allocate {nbytes} bytes of {'pinned' if pinned else 'pageable'} host memory: "
                            f"{exc}") from exc
    return array


_default: HostPool | None = None
_default_lock = threading.Lock()


def default_pool() -> HostPool:
    """The process-wide pool that snapshots use when none is given."""
    global _default
    with _default_lock:
        if _default is None:
            _default = HostPool()
        return _default
