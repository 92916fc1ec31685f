"""Argument checks shared by kvrt's public API: one helper per kind of value.

Each helper returns the value normalised (a plain ``int``, ``float``, ``str`` or list of
token ids) or raises ``error`` (a :class:`~kvrt.errors.KvrtError` subclass, by default
:class:`~kvrt.errors.InvalidArgument`) naming the argument, what it must be and what it
got. None of them allocates or calls llama.cpp, so a call can check every argument
before it does anything.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable

import numpy as np

from kvrt.errors import InvalidArgument, KvrtError

_SHOWN = 60
INT32_MAX = 2**31 - 1  # llama.cpp's positions, token counts and most sizes are int32


def shown(value: object) -> str:
    """``value``'s type and a repr short enough for a message."""
    text = repr(value)
    if len(text) > _SHOWN:
        text = text[:_SHOWN] + "…"
    return f"{type(value).__name__} {text}"


def check_int(value: object, what: str, *, low: int | None = None, high: int | None = None,
              noun: str = "an integer", error: type[KvrtError] = InvalidArgument) -> int:
    """``value`` as an ``int`` in ``[low, high]``; bools, floats and strings refused (NumPy integers accepted)."""
    if isinstance(value, bool):
        raise error(f"{what} must be {noun}, got {shown(value)}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{what} must be {noun}, got {shown(value)}") from None
    if (low is not None and n < low) or (high is not None and n > high):
        if low is not None and high is not None:
            raise error(f"{what} {n} is outside [{low}, {high}]")
        raise error(f"{what} must be >= {low}, got {n}" if low is not None else f"{what} must be <= {high}, got {n}")
    return n


def check_real(value: object, what: str, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False,
               high_open: bool = False, error: type[KvrtError] = InvalidArgument) -> float:
    """``value`` as a finite ``float`` in the interval from ``low`` to ``high`` (``*_open``: that end excluded).

    Bools, strings, NaN and infinities are refused.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be a number, got {shown(value)}")
    try:
        x = float(value)
    except OverflowError:  # an int or Fraction past the float range
        raise error(f"{what} must be a finite number, got {shown(value)}") from None
    if not math.isfinite(x):
        raise error(f"{what} must be a finite number, got {x}")
    if (x <= low if low_open else x < low) or (x >= high if high_open else x > high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise error(f"{what} must be in {interval}, got {x:g}")
    return x


def check_text(value: object, what: str, *, error: type[KvrtError] = InvalidArgument) -> str:
    """``value`` as a non-empty ``str`` that UTF-8 can encode (what llama.cpp's tokenizer is given)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise error(f"{what} must be text (str), got {shown(value)}: decode it first")
    if not isinstance(value, str):
        raise error(f"{what} must be text (str), got {shown(value)}")
    if not value:
        raise error(f"{what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} cannot be encoded as UTF-8: {exc.reason} {value[exc.start]!r} at character "
                    f"{exc.start}") from None
    return value


def check_tokens(value: object, what: str, n_vocab: int, *, expected: str = "a sequence of token ids",
                 error: type[KvrtError] = InvalidArgument) -> list[int]:
    """``value`` as a non-empty list of token ids in ``[0, n_vocab)``; text and bytes are refused, not iterated."""
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Iterable) or (
            isinstance(value, np.ndarray) and value.ndim != 1):
        raise error(f"{what} must be {expected}, got {shown(value)}")
    tokens = value.tolist() if isinstance(value, np.ndarray) else list(value)
    if not tokens:
        raise error(f"{what} is empty")
    if not all(type(t) is int for t in tokens):
        tokens = [check_int(t, f"{what}[{i}]", noun="a token id (int)", error=error) for i, t in enumerate(tokens)]
    low, high = min(tokens), max(tokens)
    if low < 0 or high >= n_vocab:
        i, bad = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < n_vocab)
        raise error(f"{what}[{i}] = {bad} is outside the vocabulary [0, {n_vocab})")
    return tokens
