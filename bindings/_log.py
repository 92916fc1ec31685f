"""Route llama.cpp's log lines into Python's :mod:`logging`, and capture them.

llama.cpp explains most failures only in its log (a NULL model says nothing by itself),
so while a call runs under :func:`capture` its error lines are kept and put into the
exception kvrt raises.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvrt.bindings._ffi import ffi

logger = logging.getLogger("kvrt.llama")

# ggml_log_level: NONE=0 DEBUG=1 INFO=2 WARN=3 ERROR=4 CONT=5
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_local = threading.local()
_install_lock = threading.Lock()


class _Hook:
    """kvrt's llama.cpp log callback, chained to whichever callback was installed before it.

    llama.cpp has one process-wide log callback. llama-cpp-python installs its own when it
    is imported; kvrt's hook calls that one too (so ``Llama(verbose=True)`` still prints),
    and :func:`capture` re-installs the hook, chaining again, if something replaced it.
    """

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.callback = ffi.callback("void(int, const char *, void *)", self._on_log)
        self.previous: tuple[Any, Any] = (ffi.NULL, ffi.NULL)
        self.default = self._llama_default()

    def _llama_default(self) -> Any:
        """llama.cpp's own stderr printer, which the hook must not chain to (it would print every line)."""
        current, current_data = ffi.new("ggml_log_callback *"), ffi.new("void **")
        self._lib.llama_log_get(current, current_data)
        self._lib.llama_log_set(ffi.NULL, ffi.NULL)  # NULL selects the default printer
        default = ffi.new("ggml_log_callback *")
        self._lib.llama_log_get(default, current_data)
        self._lib.llama_log_set(current[0], current_data[0] if current[0] != default[0] else ffi.NULL)
        return default[0]

    def _on_log(self, level: int, text: Any, user_data: Any) -> None:
        line = ffi.string(text).decode("utf-8", "replace").rstrip("\n")
        sink = getattr(_local, "sink", None)
        if line and sink is not None and level in (3, 4):
            sink.append(line)
        py_level = _LEVELS.get(level, logging.DEBUG)
        if line and logger.isEnabledFor(py_level):
            logger.log(py_level, "%s", line)
        previous, previous_data = self.previous
        if previous != ffi.NULL:
            previous(level, text, previous_data)

    def ensure_installed(self) -> None:
        """Install the hook unless it is llama.cpp's current callback (cheap when it is)."""
        current, current_data = ffi.new("ggml_log_callback *"), ffi.new("void **")
        self._lib.llama_log_get(current, current_data)
        if current[0] == self.callback:
            return
        with _install_lock:
            self._lib.llama_log_get(current, current_data)
            if current[0] != self.callback:
                chained = current[0] != self.default
                self.previous = (current[0], current_data[0]) if chained else (ffi.NULL, ffi.NULL)
                self._lib.llama_log_set(self.callback, ffi.NULL)


_hook: _Hook | None = None


def install(lib: Any) -> None:
    """Send llama.cpp's logging through :data:`logger`, keeping the callback installed before.

    ``lib``: the opened libllama (the loader installs the hook as it opens it, before any call that logs).
    """
    global _hook
    if _hook is None:
        with _install_lock:
            if _hook is None:
                _hook = _Hook(lib)
    _hook.ensure_installed()


@contextmanager
def capture() -> Iterator[list[str]]:
    """Collect llama.cpp's warning and error lines logged by this thread meanwhile.

    The hook is installed again first if something replaced it; before the libraries are open
    there is none yet, and the loader installs it as it opens them.
    """
    if _hook is not None:
        _hook.ensure_installed()
    previous = getattr(_local, "sink", None)
    lines: list[str] = []
    _local.sink = lines
    try:
        yield lines
    finally:
        _local.sink = previous


def explain(lines: list[str], fallback: str) -> str:
    """The last few captured lines, or ``fallback`` when llama.cpp said nothing."""
    return " | ".join(lines[-3:]) if lines else fallback
