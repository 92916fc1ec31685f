"""Ownership of one native handle: freed exactly once, never used after."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvrt.bindings import ffi
from kvrt.errors import ClosedError, KvrtError


class NativeHandle:
    """Holds a cffi pointer and the function that frees it.

    ``borrowed`` handles belong to someone else (a ``llama_cpp.Llama``), so closing
    only forgets them. After :meth:`close`, :attr:`ptr` raises :class:`ClosedError`
    instead of handing a dangling pointer to C.
    """

    __slots__ = ("_ptr", "_free", "_what", "borrowed")

    def __init__(self, ptr: Any, free: Callable[[Any], None], what: str, *, borrowed: bool = False) -> None:
        if ptr == ffi.NULL:
            raise ValueError(f"{what}: NULL handle")
        self._ptr = ptr
        self._free = free
        self._what = what
        self.borrowed = borrowed

    @classmethod
    def borrow(cls, ctypes_pointer: Any, c_type: str, what: str) -> NativeHandle:
        """A handle on a ctypes pointer that llama-cpp-python owns: usable here, never freed here."""
        import ctypes

        address = ctypes.cast(ctypes_pointer, ctypes.c_void_p).value
        if not address:
            raise KvrtError(f"the llama_cpp.Llama holds no {what} (was it closed?)")
        return cls(ffi.cast(c_type, address), _never_called, what, borrowed=True)

    @property
    def ptr(self) -> Any:
        if self._ptr is None:
            raise ClosedError(f"{self._what} was already freed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is not None and not self.borrowed:
            self._free(ptr)


def _never_called(ptr: Any) -> None:
    raise AssertionError("a borrowed handle is never freed by kvrt")


class OwnsHandle:
    """Lifetime protocol of objects that own one :class:`NativeHandle` in ``self._handle``.

    Deterministic release through ``close()`` or ``with``; the finaliser is only the
    safety net for objects nobody closed.
    """

    _handle: NativeHandle

    @property
    def ptr(self) -> Any:
        return self._handle.ptr

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def close(self) -> None:
        self._handle.close()

    def __enter__(self):  # noqa: ANN204  (returns the subclass)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()
