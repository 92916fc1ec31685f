"""What the KV stager (:mod:`kvrt.state.staging`) hands out and reports: errors, pending captures, timing records.

A :class:`PendingSnapshot` stands for one agent's state being captured out of its context
on the copy-out thread: it wraps a :class:`concurrent.futures.Future` that the thread
completes and never touches a context itself. (A prefetch's handle, which owns a staging
context, is :class:`kvrt.state.staging.PrefetchHandle`.)
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from kvrt.errors import KvrtError
from kvrt.state.snapshot import Snapshot


class StagingError(KvrtError):
    """A staging call was refused or a staged copy failed; the message says which and why."""


class StagingFull(StagingError):
    """No staging context is free, none is being drained, and no new one may be added. Nothing changed.

    ``busy`` counts the stager's contexts by state; ``max_contexts`` is its bound;
    ``denied`` is the ledger's refusal when the bound still had room.
    """

    def __init__(self, busy: dict[str, int], max_contexts: int, denied: KvrtError | None) -> None:
        self.busy = busy
        self.max_contexts = max_contexts
        self.denied = denied
        held = ", ".join(f"{n} {state}" for state, n in busy.items() if n) or "none"
        why = (f"the ledger refused another: {denied}" if denied is not None
               else f"the stager holds its maximum of {max_contexts}")
        super().__init__(f"no staging context for a prefetch: {sum(busy.values())} held ({held}) and {why}; "
                         "activate or swap out an agent first, or restore synchronously")


class PrefetchCancelled(StagingError):
    """The prefetch was cancelled (or its stager closed) before it was activated."""


@dataclass(frozen=True)
class ActivationRecord:
    """How one activation went. Times in ms on ``time.perf_counter``.

    ``restore_ms``: the restore itself on the copy-in thread (host bookkeeping and the
    transfer); ``stage_ms``: the whole staging job (waiting for a drain of its context,
    creating the context, the restore); ``exposed_ms``: what :meth:`KVStager.activate`
    waited on the caller's thread, the only part on the decode path.
    """

    n_tokens: int
    nbytes: int
    restore_ms: float
    stage_ms: float
    exposed_ms: float
    created_context: bool


@dataclass(frozen=True)
class SwapOutRecord:
    """One capture on the copy-out thread: its size and time (ms)."""

    n_tokens: int
    nbytes: int
    capture_ms: float


@dataclass(frozen=True)
class StagerStats:
    """Totals since the stager was made (times in ms); ``contexts``: staging contexts charged (kept until close)."""

    contexts: int
    prefetches: int
    activations: int
    ready_at_activation: int
    cancelled: int
    failed: int
    swap_outs: int
    bytes_in: int
    bytes_out: int
    restore_ms: float
    exposed_ms: float
    capture_ms: float

    @property
    def hidden_fraction(self) -> float:
        """The share of restore time the activations did not wait for."""
        return 1.0 - min(self.exposed_ms / self.restore_ms, 1.0) if self.restore_ms > 0 else 1.0


class PendingSnapshot:
    """A capture running (or queued) on the copy-out thread; :meth:`result` gives the :class:`Snapshot`.

    The snapshot belongs to the caller once it is produced (release it). If the capture
    fails, :meth:`result` raises and the agent stays in its context, activated again.
    """

    def __init__(self, future: Future[tuple[Snapshot, SwapOutRecord]]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Snapshot:
        """The captured snapshot (waits for it); raises the capture's error."""
        return self._future.result(timeout)[0]

    @property
    def record(self) -> SwapOutRecord:
        """The capture's size and time (waits for it)."""
        return self._future.result()[1]

    def _wait(self) -> None:
        """Wait for the capture without taking its result (a prefetch queued behind this drain)."""
        self._future.exception()
