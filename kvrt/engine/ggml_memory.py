"""ggml buffers over memory kvrt owns: a host array wrapped as a ggml CPU buffer without a copy.

ggml asserts (aborts the process) on a misaligned pointer, so alignment is checked here first.
The devices ggml sees are :func:`kvrt.system.gpu.llama_devices`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvrt._handle import NativeHandle, OwnsHandle
from kvrt.bindings import ffi, ggml
from kvrt.errors import KvrtError, LlamaError

TENSOR_ALIGNMENT = 32
"""ggml's required alignment of a buffer's base pointer (``TENSOR_ALIGNMENT`` in ggml-impl.h)."""


class Buffer(OwnsHandle):
    """A ggml backend buffer: device memory from a device's buffer type, or wrapped host memory."""

    def __init__(self, ptr: Any, what: str, keep_alive: Any = None) -> None:
        self._handle = NativeHandle(ptr, ggml().ggml_backend_buffer_free, what)
        self._keep_alive = keep_alive  # host memory a wrapped buffer points into

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
