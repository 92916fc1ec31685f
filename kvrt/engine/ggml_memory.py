"""ggml's view of devices and buffers: what memory llama.cpp's backends have and hand out.

The ledger reads device memory from here where NVML is absent, and a host buffer kvrt
owns can be wrapped as a ggml CPU buffer without a copy. ggml asserts (aborts the
process) on a misaligned pointer, so alignment is checked here first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrt._handle import NativeHandle, OwnsHandle
from kvrt.bindings import DEVICE_TYPES, ffi, ggml
from kvrt.errors import KvrtError, LlamaError

TENSOR_ALIGNMENT = 32
"""ggml's required alignment of a buffer's base pointer (``TENSOR_ALIGNMENT`` in ggml-impl.h)."""


@dataclass(frozen=True)
class Device:
    """One ggml backend device and its memory, as the backend reports it now."""

    index: int
    name: str
    description: str
    kind: str
    free_bytes: int
    total_bytes: int


def devices() -> list[Device]:
    """Every device the loaded ggml backends expose (the CPU is always one of them)."""
    g = ggml()
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    found = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        g.ggml_backend_dev_memory(dev, free, total)
        found.append(Device(
            index=i,
            name=ffi.string(g.ggml_backend_dev_name(dev)).decode(),
            description=ffi.string(g.ggml_backend_dev_description(dev)).decode(),
            kind=DEVICE_TYPES.get(g.ggml_backend_dev_type(dev), "unknown"),
            free_bytes=int(free[0]),
            total_bytes=int(total[0]),
        ))
    return found


class Buffer(OwnsHandle):
    """A ggml backend buffer: device memory from a device's buffer type, or wrapped host memory."""

    def __init__(self, ptr: Any, what: str, keep_alive: Any = None) -> None:
        self._handle = NativeHandle(ptr, ggml().ggml_backend_buffer_free, what)
        self._keep_alive = keep_alive  # host memory a wrapped buffer points into

    @classmethod
    def on_device(cls, device_index: int, nbytes: int) -> Buffer:
        """Allocate ``nbytes`` from a device's default buffer type."""
        g = ggml()
        if not 0 <= device_index < g.ggml_backend_dev_count():
            raise KvrtError(f"no ggml device {device_index} (there are {g.ggml_backend_dev_count()})")
        buft = g.ggml_backend_dev_buffer_type(g.ggml_backend_dev_get(device_index))
        ptr = g.ggml_backend_buft_alloc_buffer(buft, nbytes)
        if ptr == ffi.NULL:
            raise LlamaError("ggml_backend_buft_alloc_buffer", "allocation failed", device=device_index, nbytes=nbytes)
        return cls(ptr, f"ggml buffer on device {device_index}")

    @classmethod
    def wrap_host(cls, array: np.ndarray) -> Buffer:
        """Expose a C-contiguous host array to ggml as a CPU buffer, sharing its memory."""
        if not array.flags.c_contiguous:
            raise KvrtError("only C-contiguous host memory can be wrapped as a ggml buffer")
        address = array.ctypes.data
        if address % TENSOR_ALIGNMENT:
            raise KvrtError(f"host pointer {address:#x} is not {TENSOR_ALIGNMENT}-byte aligned as ggml requires")
        ptr = ggml().ggml_backend_cpu_buffer_from_ptr(ffi.cast("void *", address), array.nbytes)
        if ptr == ffi.NULL:
            raise LlamaError("ggml_backend_cpu_buffer_from_ptr", "returned NULL", nbytes=array.nbytes)
        return cls(ptr, "wrapped host buffer", keep_alive=array)

    @property
    def base(self) -> int:
        return int(ffi.cast("uintptr_t", ggml().ggml_backend_buffer_get_base(self._handle.ptr)))

    @property
    def nbytes(self) -> int:
        return int(ggml().ggml_backend_buffer_get_size(self._handle.ptr))

    @property
    def is_host(self) -> bool:
        return bool(ggml().ggml_backend_buffer_is_host(self._handle.ptr))

    def close(self) -> None:
        super().close()
        self._keep_alive = None


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on an ``alignment`` boundary."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes]
