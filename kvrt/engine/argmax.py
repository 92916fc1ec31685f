"""The first maximum of each row of a logits matrix, on several threads when the matrix is large.

Greedy decoding of 32 sequences of a 152k-token vocabulary reads 19.5 MB of logits a step; one NumPy
``argmax`` over them is ~1.2-2.5 ms of the step's host time, while the GPU waits for the next batch.
NumPy releases the GIL inside ``argmax``, so row groups on a few threads finish in a fraction of that.
Each row's pick is exactly ``matrix.argmax(axis=1)``'s: the split is by whole rows.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PARALLEL_MIN_VALUES = 1 << 20
"""Below this many logits (4 MiB of float32) one thread is faster than handing rows out."""

_WORKERS = max(1, min(8, os.cpu_count() or 1))
_POOL = ThreadPoolExecutor(_WORKERS, thread_name_prefix="kvrt-argmax")  # its threads start at the first use


def argmax_rows(matrix: np.ndarray) -> np.ndarray:
    """``matrix.argmax(axis=1)``: each row's first highest entry, rows split among threads when large."""
    rows = matrix.shape[0]
    parts = min(_WORKERS, rows)
    if parts < 2 or matrix.size < PARALLEL_MIN_VALUES:
        picks: np.ndarray = matrix.argmax(axis=1)
        return picks
    bounds = np.linspace(0, rows, parts + 1).astype(int)
    groups = _POOL.map(lambda a, b: matrix[a:b].argmax(axis=1), bounds[:-1], bounds[1:])
    return np.concatenate(list(groups))

