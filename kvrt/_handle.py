"""Ownership of one native handle: freed exactly once, never used after."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self

from kvrt.bindings import ffi
from kvrt.errors import ClosedError, KvrtError


class NativeHandle:
    """Holds a cffi pointer and the function that frees it.

    ``borrowed`` handles belong to someone else (a ``llama_cpp.Llama``), so closing
    only forgets them. After :meth:`close`, :attr:`ptr` raises :class:`ClosedError`
    instead of handing a dangling pointer to C. Calls into C that may run while another
    thread closes the handle hold :meth:`use`: :meth:`close` refuses new users at once and
    frees only when the running ones are done (llama_free under a running llama_decode
    killed the process).
    """

    __slots__ = ("_ptr", "_free", "_what", "borrowed", "_idle", "_users")

    def __init__(self, ptr: Any, free: Callable[[Any], None], what: str, *, borrowed: bool = False) -> None:
        if ptr == ffi.NULL:
            raise ValueError(f"{what}: NULL handle")
        self._ptr = ptr
        self._free = free
        self._what = what
        self.borrowed = borrowed
        self._idle = threading.Condition(threading.Lock())
        self._users: dict[int, int] = {}  # thread id -> calls it is inside

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

    @contextmanager
    def use(self) -> Iterator[Any]:
        """The pointer, kept alive (not freed by :meth:`close` on another thread) until the block ends."""
        me = threading.get_ident()
        with self._idle:
            if self._ptr is None:
                raise ClosedError(f"{self._what} was already freed")
            self._users[me] = self._users.get(me, 0) + 1
            ptr = self._ptr
        try:
            yield ptr
        finally:
            with self._idle:
                left = self._users[me] - 1
                if left:
                    self._users[me] = left
                else:
                    del self._users[me]
                    self._idle.notify_all()

    def close(self) -> None:
        """Free the pointer once no other thread is inside a call on it (new calls are refused at once)."""
        idle = getattr(self, "_idle", None)
        if idle is None:  # a half-built object's finaliser
            return
        with idle:
            if threading.get_ident() in self._users:
                raise KvrtError(f"{self._what} cannot be closed from inside a call on it")
            ptr, self._ptr = self._ptr, None
            while self._users:
                idle.wait()
        if ptr is not None and not self.borrowed:
            self._free(ptr)

    def used_by_others(self, me: int) -> bool:
        """Some thread other than ``me`` is inside a call on it."""
        with self._idle:
            return any(thread != me for thread in self._users)


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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()
