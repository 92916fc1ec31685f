"""Samples, their summary (median and spread) and the result files every harness writes.

A benchmark figure is the median of at least :data:`MIN_SAMPLES` samples, reported with
its minimum and maximum, never one run; a ratio between two arms is taken per sample
(both arms measured in the same round, so machine load hits both alike) and summarised
the same way.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvrt.errors import KvrtError

MIN_SAMPLES = 3


@dataclass(frozen=True)
class Summary:
    """Median, minimum and maximum of ``n`` samples; ``spread`` is (max - min) / median."""

    n: int
    median: float
    min: float
    max: float

    @property
    def spread(self) -> float:
        return (self.max - self.min) / self.median if self.median else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "spread": self.spread}

    def text(self, fmt: str = ".1f") -> str:
        """``median [min-max] (n)``, the form the tables use."""
        return f"{self.median:{fmt}} [{self.min:{fmt}}-{self.max:{fmt}}] (n={self.n})"


def summarize(values: Iterable[float]) -> Summary:
    """The summary of ``values`` (at least one)."""
    data = [float(v) for v in values]
    if not data:
        raise KvrtError("no samples to summarise")
    return Summary(len(data), float(statistics.median(data)), min(data), max(data))


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Summary:
    """Per-sample ratios ``numerators[i] / denominators[i]`` (same rounds), summarised."""
    if len(numerators) != len(denominators):
        raise KvrtError(f"ratio of {len(numerators)} samples to {len(denominators)}: rounds do not pair up")
    return summarize(a / b for a, b in zip(numerators, denominators))


def check_samples(samples: int) -> int:
    """``samples`` itself; refuses fewer than :data:`MIN_SAMPLES` (a figure needs a median and a spread)."""
    if samples < MIN_SAMPLES:
        raise KvrtError(f"{samples} samples: every figure needs at least {MIN_SAMPLES} (median and spread)")
    return samples


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Rows as CSV, the first row's keys as the header (nothing written for no rows)."""
    if not rows:
        return
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON (non-JSON values as their str)."""
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def machine() -> dict[str, Any]:
    """Where and when a result was measured: host, Python, CPUs and their load, the GPU (NVML), the argv."""
    import os
    import platform
    import sys
    from datetime import UTC, datetime

    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "node": platform.node(),
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()), "gpu": _gpu_name(), "argv": sys.argv}


def _gpu_name() -> str | None:
    """The first NVIDIA GPU's name through NVML, or None where there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library: a CPU machine
        return None
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    finally:
        pynvml.nvmlShutdown()
