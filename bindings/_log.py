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

from kvrt.bindings._loader import ffi, llama

logger = logging.getLogger("kvrt.llama")

# ggml_log_level: NONE=0 DEBUG=1 INFO=2 WARN=3 ERROR=4 CONT=5
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_local = threading.local()
_installed: list[Any] = []
_install_lock = threading.Lock()


def _on_log(level: int, text: Any, _user: Any) -> None:
    line = ffi.string(text).decode("utf-8", "replace").rstrip("\n")
    if not line:
        return
    sink = getattr(_local, "sink", None)
    if sink is not None and level in (3, 4):
        sink.append(line)
    py_level = _LEVELS.get(level, logging.DEBUG)
    if logger.isEnabledFor(py_level):
        logger.log(py_level, "%s", line)


def install() -> None:
    """Send llama.cpp's logging through :data:`logger` (idempotent)."""
    with _install_lock:
        if _installed:
            return
        callback = ffi.callback("void(int, const char *, void *)", _on_log)
        _installed.append(callback)  # keep alive for the life of the process
        llama().llama_log_set(callback, ffi.NULL)


@contextmanager
def capture() -> Iterator[list[str]]:
    """Collect llama.cpp's warning and error lines logged by this thread meanwhile."""
    install()
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
