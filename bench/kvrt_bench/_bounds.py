"""Physical bounds on benchmark figures, checked on every run: a figure past its bound fails the run.

A speed-up of kvrt over an equally warm baseline cannot exceed what the baseline does
in excess (N prefills against one for N branches: at most N); no system runs faster
than the ideal it is measured against (a fraction of the ideal is at most 1). A figure
over its bound by more than the tolerance is a broken baseline or broken timing, not a
result: the harness writes its data first (so it can be inspected), then lists every
such figure with its value and bound and exits non-zero.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrt_bench._stats import write_json

DEFAULT_TOLERANCE = 0.05
EXIT_BOUND_VIOLATED = 3


@dataclass(frozen=True)
class Bound:
    """A figure, its measured value, the most it can physically be, and why."""

    figure: str
    value: float
    bound: float
    why: str

    def exceeded(self, tolerance: float) -> bool:
        return self.value > self.bound * (1.0 + tolerance)

    def message(self) -> str:
        return f"BOUND VIOLATED: {self.figure} = {self.value:.4g} > bound {self.bound:.4g} ({self.why})"


def speedup_bound(figure: str, value: float, n_branches: int) -> Bound:
    """Fan-out of ``n_branches`` against an equally warm sequential baseline: at most N."""
    return Bound(figure, value, float(n_branches),
                 f"{n_branches} branches: the warm baseline does {n_branches} prefills, anything else at least one")


def ideal_bound(figure: str, fraction: float, ideal: str) -> Bound:
    """A fraction of the ideal (ideal time / measured time): at most 1."""
    return Bound(figure, fraction, 1.0, f"nothing runs faster than the ideal, {ideal}")


def violations(bounds: Sequence[Bound], tolerance: float) -> list[Bound]:
    """The bounds exceeded by more than ``tolerance`` (relative)."""
    return [b for b in bounds if b.exceeded(tolerance)]


def enforce(bounds: Sequence[Bound], tolerance: float, out: Path) -> int:
    """Write ``out/bounds.json``, print every violation to stderr; the exit code (0, or 3 on a violation)."""
    bad = violations(bounds, tolerance)
    write_json(out / "bounds.json", {"tolerance": tolerance, "violated": len(bad),
                                     "bounds": [asdict(b) | {"ok": not b.exceeded(tolerance)} for b in bounds]})
    for b in bad:
        print(b.message() + f" [tolerance {tolerance:.0%}]", file=sys.stderr)
    print(f"bounds: {len(bounds)} checked, {len(bad)} violated (tolerance {tolerance:.0%}; {out / 'bounds.json'})",
          file=sys.stderr)
    return EXIT_BOUND_VIOLATED if bad else 0
