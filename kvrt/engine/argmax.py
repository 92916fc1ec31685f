"""The first maximum of each row of a logits matrix, on several threads when the matrix is large.

Greedy decoding of 32 sequences of a 152k-token vocabulary reads 19.5 MB of logits a step, while the GPU waits
for the next batch. NumPy releases the GIL inside ``argmax``, so row groups on a few threads can finish in a
fraction of one thread's time; but each worker takes the GIL to start its group, and beside busy Python threads
(the HTTP front streaming tokens) every such hand-off may cost a switch interval. :func:`set_threads` chooses
(``kvrt serve --argmax-threads``; 1: one NumPy call on the caller's thread, one hand-off).
Each row's pick is exactly ``matrix.argmax(axis=1)``'s: the split is by whole rows.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvrt.checks import check_int

PARALLEL_MIN_VALUES = 1 << 20
"""Below this many logits (4 MiB of float32) one thread is faster than handing rows out."""

DEFAULT_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
"""Half the CPUs, at most 8: on two cores a second worker only adds the hand-offs (``bench/RESULTS.md``, "A decode
step's greedy picks on one thread or two")."""


class _Pool:
    """The worker threads (an executor's threads start at its first split; none while ``threads`` is 1)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="kvrt-argmax") if threads > 1 else None

    def map_rows(self, matrix: np.ndarray, parts: int) -> np.ndarray:
        assert self.executor is not None  # parts >= 2 only where threads >= 2
        bounds = np.linspace(0, matrix.shape[0], parts + 1).astype(int)
        groups = self.executor.map(lambda a, b: matrix[a:b].argmax(axis=1), bounds[:-1], bounds[1:])
        return np.concatenate(list(groups))


_pool = _Pool(DEFAULT_THREADS)


def set_threads(threads: int) -> None:
    """Split large matrices among ``threads`` threads from now on (1: never split). Process-wide, like the GIL
    it works around; the previous workers finish what they hold and exit."""
    global _pool
    old, _pool = _pool, _Pool(check_int(threads, "argmax threads", low=1))
    if old.executor is not None:
        old.executor.shutdown(wait=False)


def argmax_rows(matrix: np.ndarray) -> np.ndarray:
    """``matrix.argmax(axis=1)``: each row's first highest entry, rows split among threads when large."""
    pool = _pool
    parts = min(pool.threads, matrix.shape[0])
    if parts < 2 or matrix.size < PARALLEL_MIN_VALUES:
        picks: np.ndarray = matrix.argmax(axis=1)
        return picks
    return pool.map_rows(matrix, parts)
