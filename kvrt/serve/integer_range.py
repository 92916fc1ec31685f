"""GBNF for exactly the integers of a range, written as JSON writes them (a digit-range construction).

llama-cpp-python's schema converter writes every ``integer`` as ``"-"? integral-part`` and
ignores ``minimum`` / ``maximum``; :func:`integer_range` is what :mod:`kvrt.serve.json_grammar`
puts in its place when a schema bounds an integer. The text accepted is canonical: ``0``, or
an optional ``-`` then a first digit 1-9 then digits (no ``-0``, no leading zeros). A range
is cut by digit count; numbers of one count between two bounds are written digit by digit,
from the first digit on (``[1-9] [0-9]{2}`` for 100..999, ``"1" ("2" [5-9] | [3-9] [0-9])``
for 125..199). An open side stops at :data:`OPEN_DIGITS` digits (or at the other bound's digit
count, if that is more), as the converter's plain integers do.
"""

from __future__ import annotations

OPEN_DIGITS = 16  # llama-cpp-python's integral-part: one digit then up to 15 more


def integer_range(lo: int | None, hi: int | None) -> str:
    """GBNF (an expression, no rule name) matching the decimal integers in ``[lo, hi]``; ``None`` is an open side.

    The range must hold an integer (``lo <= hi`` where both are given): the caller refuses an empty one.
    """
    lo, hi = open_bounds(lo, hi)
    if lo > hi:
        raise ValueError(f"no integer lies in [{lo}, {hi}]")
    alternatives = []
    if lo < 0:
        negative = _naturals(max(1, -hi), -lo)
        alternatives.append(f'"-" {_group(negative)}')
    if hi >= 0:
        alternatives.extend(_naturals(max(0, lo), hi))
    return _group(alternatives)


def open_bounds(lo: int | None, hi: int | None) -> tuple[int, int]:
    """``(lo, hi)`` with an open side closed at the largest number of :data:`OPEN_DIGITS` digits (or of the other
    bound's digit count, if that is more), with its sign."""
    digits = max([OPEN_DIGITS, *(len(str(abs(b))) for b in (lo, hi) if b is not None)])
    limit = 10**digits - 1
    return -limit if lo is None else lo, limit if hi is None else hi


def _naturals(lo: int, hi: int) -> list[str]:
    """Alternatives matching ``lo..hi`` (``0 <= lo <= hi``) without a sign: one for the digit counts it holds whole
    (a first digit 1-9, then any), one for each end's count that it holds in part."""
    a, b = str(lo), str(hi)
    if len(a) == len(b):
        return [_same_length(a, b)]
    whole_from = len(a) if a == "1" + "0" * (len(a) - 1) else len(a) + 1
    whole_to = len(b) if b == "9" * len(b) else len(b) - 1
    alternatives = [] if whole_from == len(a) else [_same_length(a, "9" * len(a))]
    if whole_from <= whole_to:
        alternatives.append(_sequence("[1-9]", _digits(whole_from - 1, whole_to - 1)))
    if whole_to < len(b):
        alternatives.append(_same_length("1" + "0" * (len(b) - 1), b))
    return alternatives


def _same_length(a: str, b: str) -> str:
    """A sequence matching the digit strings from ``a`` to ``b`` (equal lengths, ``a <= b``)."""
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    if common:
        return _sequence(f'"{a[:common]}"', _same_length(a[common:], b[common:]))
    if not a:
        return ""
    rest = len(a) - 1
    first, last = int(a[0]), int(b[0])
    low = high = None
    if a[1:] != "0" * rest:  # a's own first digit takes only the numbers from a up
        low = _sequence(f'"{a[0]}"', _same_length(a[1:], "9" * rest))
        first += 1
    if b[1:] != "9" * rest:  # b's own first digit takes only the numbers up to b
        high = _sequence(f'"{b[0]}"', _same_length("0" * rest, b[1:]))
        last -= 1
    middle = _sequence(_digit_class(first, last), _digits(rest, rest)) if first <= last else None
    return _group([part for part in (low, middle, high) if part is not None])


def _digit_class(first: int, last: int) -> str:
    return f'"{first}"' if first == last else f"[{first}-{last}]"


def _digits(least: int, most: int) -> str:
    """``least`` to ``most`` digits of any value (``""`` for none)."""
    if most <= 0:
        return ""
    if least == most:
        return "[0-9]" if most == 1 else f"[0-9]{{{most}}}"
    return f"[0-9]{{{least},{most}}}"


def _sequence(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"
