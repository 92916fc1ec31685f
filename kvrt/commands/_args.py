"""argparse types shared by the commands: numbers checked where they are parsed, errors naming the option."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Collection
from typing import Any

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


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


def env_name(action: argparse.Action) -> str:
    """``--n-ctx`` -> ``KVRT_N_CTX``."""
    option = next(o for o in action.option_strings if o.startswith("--"))
    return "KVRT_" + option[2:].upper().replace("-", "_")


def env_defaults(parser: argparse.ArgumentParser) -> None:
    """Every long option of ``parser`` takes its default from ``KVRT_<OPTION>`` when that is set and non-empty;
    the command line wins. Each option's help names its variable.

    A value is converted like the command line's, when the option is absent from it (argparse
    converts a string default then), so a bad variable is reported by the option it stands for.
    Flags take 1/0, true/false, yes/no, on/off; a repeatable option (``--model``) takes several
    values separated by ``os.pathsep``.
    """
    for action in parser._actions:
        if not any(o.startswith("--") for o in action.option_strings) or action.dest == "help":
            continue
        name = env_name(action)
        action.help = f"{action.help or ''} [env {name}]".strip()
        raw = os.environ.get(name, "")
        if raw:
            action.default = _env_value(action, name, raw)


def _env_value(action: argparse.Action, name: str, raw: str) -> Any:
    """What ``raw`` stands for as ``action``'s default."""
    if action.nargs == 0:  # a flag: store_true / store_false / --x/--no-x
        action.type = _yes_no(name, flip=action.const is False)  # store_false's default is the flag's absence
        return raw  # converted (or refused, naming the option) only when the command line leaves the flag out
    if isinstance(action, argparse._AppendAction):
        return [part for part in raw.split(os.pathsep) if part]
    if action.choices is not None:
        action.type = _one_of(tuple(action.choices), action.type)
    return raw


def _yes_no(name: str, *, flip: bool) -> Callable[[str], bool]:
    """argparse type of a flag's variable: a yes or no word as the flag's value. argparse calls it on the string
    default only when the command line leaves the flag out, so a bad variable fails the command that uses it,
    named by its option, and no other."""
    def convert(text: str) -> bool:
        word = text.strip().lower()
        if word not in TRUE_WORDS + FALSE_WORDS:
            raise argparse.ArgumentTypeError(f"{name}={text!r} is not a yes or no (one of "
                                             f"{', '.join(TRUE_WORDS + FALSE_WORDS)})")
        return (word in TRUE_WORDS) != flip

    return convert


def _one_of(choices: Collection[Any], convert: Any) -> Callable[[str], Any]:
    """argparse type: ``convert(text)`` that must be one of ``choices`` (argparse checks a string default's type,
    never its choices)."""
    def check(text: str) -> Any:
        value = convert(text) if callable(convert) else text
        if value not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(map(str, choices))}, got {text!r}")
        return value

    return check
