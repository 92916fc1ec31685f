#!/usr/bin/env python3
"""How fast can the host pick greedy tokens from logits a GPU just copied out? (GPU-machine probe, issue 24)

A decode step of 32 sequences of a 152k-token vocabulary leaves 19.5 MB of logits in llama.cpp's
pinned output buffer; kvrt's engine reads them with :func:`kvrt.engine.argmax.argmax_rows` before
the next step can start. The step traces put that sample phase at 1.4-1.9 ms on the GPU machines,
while the same argmax over a cache-warm array takes a fraction of it here. This probe separates
the two: each repetition copies fresh logits from the device into a pinned buffer (as llama.cpp
does), then times kvrt's ``argmax_rows`` over it with the rows split among 1, 2, 4, 8 and 16
threads and kvrt's default (``set_threads``), each alone and beside a busy Python thread; the
picks are checked against ``argmax(axis=1)`` of the same buffer.
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
from collections.abc import Iterator

import kvrt  # noqa: F401  (loads llama.cpp before NumPy and CuPy: see DEVELOPING.md)
import cupy
import cupyx
import numpy as np

from kvrt.engine.argmax import DEFAULT_THREADS, argmax_rows, set_threads

THREADS = {"1 thread": 1, "2 threads": 2, "4 threads": 4, "8 threads": 8, "16 threads": 16,
           "kvrt argmax_rows": DEFAULT_THREADS}
"""What is timed: ``argmax_rows`` with its rows split among this many threads (1: one NumPy call); the last is
kvrt's default for this machine."""


@contextlib.contextmanager
def busy_python_thread() -> Iterator[None]:
    """One thread running Python meanwhile, as the HTTP front's are while a step's tokens stream: every GIL hand-off
    of the picks may then wait for the switch interval."""
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    busy.start()
    try:
        yield
    finally:
        stop.set()
        busy.join()


def time_picks(threads: int, device: cupy.ndarray, host: np.ndarray, reps: int) -> float:
    """Median milliseconds of ``argmax_rows`` on ``threads`` threads over ``host``, each right after a fresh
    device-to-host copy into it (two repetitions first, unrecorded, start the pool's threads)."""
    set_threads(threads)
    times = []
    for rep in range(reps + 2):
        device.get(out=host)  # waits for the copy, as llama.cpp's synchronize does before kvrt reads
        t0 = time.perf_counter()
        picks = argmax_rows(host)
        if rep >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
        if not np.array_equal(picks, host.argmax(axis=1)):
            raise SystemExit(f"argmax_rows on {threads} threads picked rows other than argmax(axis=1)")
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
    results = {name: time_picks(threads, device, host, args.reps) for name, threads in THREADS.items()}
    with busy_python_thread():
        results |= {f"{name}, busy thread": time_picks(threads, device, host, args.reps)
                    for name, threads in THREADS.items()}
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
