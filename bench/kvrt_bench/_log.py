"""Progress lines of a harness, on stderr so that stdout keeps only its JSON summary."""

from __future__ import annotations

import sys


def log(text: str) -> None:
    """Print ``text`` to stderr at once (a long run shows where it is)."""
    print(text, file=sys.stderr, flush=True)
