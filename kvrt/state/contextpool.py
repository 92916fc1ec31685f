"""A pool of idle llama.cpp contexts of one shape, so a branch never pays for creating one.

Creating a context allocates and clears its KV buffers, which costs more than restoring
a 3.5k-token state from pinned memory (bench/RESULTS.md, fan-out); fan-out therefore
leases contexts from here and gives them back emptied: isolated mode one-sequence
contexts, shared mode a unified-KV context with room for every branch
(:func:`kvrt.branching.branches.shared_params`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvrt.checks import check_int, shown
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.model import Model
from kvrt.errors import InvalidArgument


class ContextPool:
    """Contexts of one :class:`ContextParams` over one model, created on demand and reused.

    ``max_idle`` bounds how many released contexts are kept (the rest are freed).
    Thread-safe: branches of a pipeline lease from worker threads.
    """

    def __init__(self, model: Model, params: ContextParams, *, max_idle: int = 4) -> None:
        if not isinstance(params, ContextParams):
            raise InvalidArgument(f"a context pool needs ContextParams, got {shown(params)}")
        self.model = model
        self.params = params
        self.max_idle = check_int(max_idle, "max_idle", low=0, high=1024)
        self._idle: list[Context] = []
        self._lock = threading.Lock()
        self.created = 0
        self.reused = 0

    def acquire(self) -> Context:
        """An empty context: an idle one when there is one, else a new one."""
        with self._lock:
            if self._idle:
                self.reused += 1
                return self._idle.pop()
            self.created += 1
        return Context(self.model, self.params)

    def release(self, ctx: Context) -> None:
        """Empty ``ctx`` (metadata only: no KV bytes are cleared) and keep it for the next lease."""
        if ctx.closed:
            return
        for seq in range(ctx.n_seq_max):
            if ctx.seq_pos_max(seq) >= 0:  # O(1); seq_rm scans every cell, so skip the empty sequences
                ctx.seq_rm(seq)
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(ctx)
                return
        ctx.close()

    @contextmanager
    def lease(self) -> Iterator[Context]:
        ctx = self.acquire()
        try:
            yield ctx
        finally:
            self.release(ctx)

    def warm(self, n: int) -> None:
        """Create contexts now until ``n`` are idle (at most ``max_idle``), so the first branches find them."""
        with self._lock:
            missing = max(0, min(n, self.max_idle) - len(self._idle))
            self.created += missing
        fresh = [Context(self.model, self.params) for _ in range(missing)]
        with self._lock:
            self._idle.extend(fresh)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for ctx in idle:
            ctx.close()

    def __enter__(self) -> ContextPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
