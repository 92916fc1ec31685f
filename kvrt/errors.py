"""kvrt's exception hierarchy.

Every failure that crosses kvrt's API is a :class:`KvrtError`, so a caller can catch
one base class; the subclasses say which layer refused and carry the numbers that
explain why (a refusal without its numbers is not actionable).
"""

from __future__ import annotations

from typing import Any


class KvrtError(Exception):
    """Base class of every error kvrt raises on purpose."""


class LlamaError(KvrtError):
    """A llama.cpp or ggml call returned NULL or an error code.

    ``call`` is the C function's name, ``args`` the arguments that matter for the
    diagnosis and ``code`` the return code when there was one.
    """

    def __init__(self, call: str, message: str, *, code: int | None = None, **args: Any) -> None:
        self.call = call
        self.code = code
        self.args_ = args
        detail = ", ".join(f"{k}={v!r}" for k, v in args.items())
        code_text = f" (returned {code})" if code is not None else ""
        super().__init__(f"{call}{code_text}: {message}" + (f" [{detail}]" if detail else ""))


class ModelLoadError(LlamaError):
    """A model file could not be loaded (missing, not GGUF, truncated, unsupported)."""


class ContextError(LlamaError):
    """A context could not be created (too large for memory, bad parameters)."""


class DecodeError(LlamaError):
    """``llama_decode`` refused a batch or failed while computing it."""


class StateError(LlamaError):
    """Getting or setting a (sequence) state failed."""


class ClosedError(KvrtError):
    """An object whose native handle was already freed was used again."""


class LibraryError(KvrtError):
    """The llama.cpp shared libraries could not be found or do not match kvrt's declarations."""


class DemoModelMissing(KvrtError):
    """The demo model package is not installed."""


class InvalidArgument(KvrtError):
    """An argument of the wrong type or outside its allowed range; nothing was done."""
