"""Draw benchmark figures in a separate interpreter that never maps llama.cpp.

On the H200 machine, importing matplotlib (its C++ extensions) into a process that had
already loaded the CUDA build of llama.cpp segfaulted, after the benchmark had measured
everything; so figures are drawn by a spawned child with kvrt's llama.cpp preload off.
A figure that fails is reported and never costs the numbers, which are written first.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

from kvrt import NO_PRELOAD_ENV


def draw(plot: Callable[..., Any], *args: Any) -> bool:
    """Run ``plot(*args)`` (a module-level function) in a fresh process; True when it succeeded."""
    saved = os.environ.get(NO_PRELOAD_ENV)
    os.environ[NO_PRELOAD_ENV] = "1"
    try:
        child = multiprocessing.get_context("spawn").Process(target=plot, args=args, name=f"plot {plot.__name__}")
        child.start()
        child.join()
    finally:
        if saved is None:
            os.environ.pop(NO_PRELOAD_ENV, None)
        else:
            os.environ[NO_PRELOAD_ENV] = saved
    if child.exitcode != 0:
        print(f"  figure {plot.__name__} failed in its own process (exit code {child.exitcode}); "
              "the measured numbers are unaffected", file=sys.stderr)
    return child.exitcode == 0
