"""argparse types shared by the commands: numbers checked where they are parsed, errors naming the option."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the option in its error)."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, low: int, noun: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}")
    return value


def seconds(*, zero: bool) -> Callable[[str], float]:
    """argparse type: a finite number of seconds, > 0 (``zero``: >= 0)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {'>= 0' if zero else '> 0'}, "
                                             f"got {text!r}")
        return value

    return parse
