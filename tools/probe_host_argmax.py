#!/usr/bin/env python3
"""How fast can the host pick greedy tokens from logits a GPU just copied out? (GPU-machine probe, issue 24)

A decode step of 32 sequences of a 152k-token vocabulary leaves 19.5 MB of logits in llama.cpp's
pinned output buffer; kvrt's engine reads them with :func:`kvrt.engine.argmax.argmax_rows` before
the next step can start. The step traces put that sample phase at 1.4-1.9 ms on the GPU machines,
while the same argmax over a cache-warm array takes a fraction of it here. This probe separates
the two: each repetition copies fresh logits from the device into a pinned buffer (as llama.cpp
does), then times one row-wise argmax of it on 1, 2, 4, 8 and 16 threads, and kvrt's own
``argmax_rows``, each alone and beside a busy Python thread; the picks are checked against
``argmax(axis=1)`` of the same buffer.
Usage: probe_host_argmax.py [--rows 32] [--vocab 152064] [--reps 50] [--out F]
"""

# ruff: noqa: I001  (kvrt first: it maps llama.cpp before NumPy and CuPy are imported)
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import kvrt  # noqa: F401  (loads llama.cpp before NumPy and CuPy: see DEVELOPING.md)
import cupy
import cupyx
import numpy as np

from kvrt.engine.argmax import argmax_rows

Picker = Callable[[np.ndarray], np.ndarray]


def split_picker(threads: int) -> Picker:
    """Row groups of a matrix on ``threads`` threads, each group's ``argmax(axis=1)``."""
    pool = ThreadPoolExecutor(threads)

    def pick(matrix: np.ndarray) -> np.ndarray:
        bounds = np.linspace(0, matrix.shape[0], threads + 1).astype(int)
        return np.concatenate(list(pool.map(lambda a, b: matrix[a:b].argmax(axis=1), bounds[:-1], bounds[1:])))
    return pick


@contextlib.contextmanager
def busy_python_thread() -> Iterator[None]:
    """One thread running Python meanwhile, as the HTTP front's are while a step's tokens stream: every GIL hand-off
    of a picker may then wait for the switch interval."""
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    busy.start()
    try:
        yield
    finally:
        stop.set()
        busy.join()


def time_picker(pick: Picker, device: cupy.ndarray, host: np.ndarray, reps: int) -> float:
    """Median milliseconds of ``pick`` over ``host`` right after a fresh device-to-host copy into it."""
    times = []
    for _ in range(reps):
        device.get(out=host)  # waits for the copy, as llama.cpp's synchronize does before kvrt reads
        t0 = time.perf_counter()
        picks = pick(host)
        times.append((time.perf_counter() - t0) * 1e3)
        if not np.array_equal(picks, host.argmax(axis=1)):
            raise SystemExit("a picker's rows differ from argmax(axis=1)")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    device = cupy.random.standard_normal((args.rows, args.vocab), dtype=cupy.float32)
    host = cupyx.zeros_pinned((args.rows, args.vocab), dtype=np.float32)
    pickers: dict[str, Picker] = {"1 thread": lambda m: m.argmax(axis=1)}
    pickers |= {f"{n} threads": split_picker(n) for n in (2, 4, 8, 16)}
    pickers["kvrt argmax_rows"] = argmax_rows
    for pick in pickers.values():  # starts each pool's threads, unrecorded
        time_picker(pick, device, host, 2)
    results = {name: time_picker(pick, device, host, args.reps) for name, pick in pickers.items()}
    with busy_python_thread():
        results |= {f"{name}, busy thread": time_picker(pick, device, host, args.reps)
                    for name, pick in pickers.items()}
    megabytes = host.nbytes / 1e6
    for name, ms in results.items():
        print(f"{name:<30} {ms:7.3f} ms ({megabytes / ms:5.1f} GB/s)", flush=True)
    numa = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    numa_lines = [line for line in numa.splitlines() if "NUMA" in line or "Model name" in line]
    print("\n".join(numa_lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "median_ms": results, "megabytes": megabytes, "lscpu": numa_lines}, f,
                      indent=2)


if __name__ == "__main__":
    main()
