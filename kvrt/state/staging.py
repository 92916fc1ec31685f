"""A prefetching KV stager: the next agent's state moves into a device context while the current one computes.

Why: a swap-in is a synchronous ``llama_state_seq_set_data`` (transfer plus 230-350 ns a
cell of host bookkeeping); on the decode path all of it is exposed. The stager holds a
bounded set of one-sequence *staging contexts*, each charged to a
:class:`kvrt.accounting.ledger.VramLedger`, and two worker threads: copy-in restores a
prefetched agent's :class:`~kvrt.state.snapshot.Snapshot` into a free staging context,
copy-out captures a swapped-out agent into the host pool (pinned on a GPU machine) and
empties its context. The state is written straight into the KV tensors of the context
the agent will decode in, by llama.cpp itself, so its cell metadata is exactly what a
restore makes and activation copies nothing: it waits only for what is left of the copy.

cffi releases the GIL and llama.cpp lets two *different* contexts run on two threads, so
the copies overlap the caller's decode. On CUDA, llama.cpp copies host tensors on the
calling thread's per-thread stream, apart from the compute stream of the active context.

Invariants:

* a staging context is used by one party at a time, as its slot's state says: the
  copy-in thread while ``staging``, the caller while ``active``, the copy-out thread
  while ``draining``; ``free`` and ``ready`` contexts are touched by nobody;
* every context the stager creates is charged to the ledger before it is created and
  released when the stager closes or trims it, unless it was handed out with its charge
  (:meth:`KVStager.detach`); an adopted context brings its charge in; at most
  ``max_contexts`` are held;
* a refusal (:class:`StagingFull`, a snapshot of another model, a context the stager did
  not activate) changes nothing; a failed capture leaves the agent active in its context.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.accounting.ledger import Reservation, VramLedger
from kvrt.checks import check_int, shown
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.model import Model
from kvrt.errors import InvalidArgument
from kvrt.state.hostpool import HostPool, default_pool
from kvrt.state.snapshot import Snapshot, SnapshotMismatch
from kvrt.state.staging_records import (
    ActivationRecord,
    PendingSnapshot,
    PrefetchCancelled,
    StagerStats,
    StagingError,
    StagingFull,
    SwapOutRecord,
)
from kvrt.state.staging_slots import Slot, SlotState, SlotTable

__all__ = ["ActivationRecord", "KVStager", "PendingSnapshot", "PrefetchCancelled", "PrefetchHandle",
           "StagerStats", "StagingError", "StagingFull", "SwapOutRecord"]


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class PrefetchHandle:
    """One prefetch: give it to :meth:`KVStager.activate` once, or :meth:`cancel` it.

    Invariant: between :meth:`KVStager.prefetch` and activation or cancellation the handle
    owns one staging context; nobody else reads or writes that context meanwhile. Only its
    stager sets its slot, copy job and flags (under the stager's lock).
    """

    def __init__(self, stager: KVStager, source: Snapshot | PendingSnapshot) -> None:
        self._stager = stager
        self.source = source
        self._slot: Slot[PrefetchHandle] | None = None  # the staging context it owns, set by prefetch
        self._future: Future[ActivationRecord] | None = None
        self._cancelled = threading.Event()  # set under the stager's lock
        self.activated = False
        self.record: ActivationRecord | None = None  # set by activate

    @property
    def stager(self) -> KVStager:
        return self._stager

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def ready(self) -> bool:
        """Whether the staged state is in its context now (activation would not wait)."""
        return self._future is not None and self._future.done() and self._future.exception() is None

    def settle(self) -> None:
        """Wait until the copy job is over (done, failed or cancelled): its source is no longer read."""
        if self._future is not None:
            wait([self._future])

    def cancel(self) -> bool:
        """Give the staging context back (after the copy, if one is running); False if already activated."""
        return self._stager._cancel(self)

    def __repr__(self) -> str:
        state = ("activated" if self.activated else "cancelled" if self.cancelled
                 else "ready" if self.ready() else "staging")
        return f"PrefetchHandle({state})"


class KVStager:
    """Bounded, ledger-charged staging contexts of one model with a copy-in and a copy-out thread.

    ``params`` is the staging contexts' shape (one sequence: ``n_seq_max=1``);
    ``context_bytes`` what each is charged (default: the KV and compute-buffer estimate
    from the GGUF header, :func:`kvrt.accounting.estimate.context_estimate`). ``host_pool``
    receives swapped-out states (default: the process's pool).

    Use from one caller thread (the scheduler's); the worker threads are the stager's. A
    scheduler that knows its queue one turn ahead runs (``kvrt bench prefetch`` does)::

        handle = stager.prefetch(state[first])
        for agent, following in turns:                    # following: the agent after this one
            ctx = stager.activate(handle)                  # waits only for what is left of the copy
            handle = stager.prefetch(state[following])     # a Snapshot, or a PendingSnapshot still running
            ...decode agent's turn in ctx...
            state[agent] = stager.swap_out_async(ctx)      # captured while the next agent computes

    Two staging contexts are the least this needs (the active agent's and the next one's).
    """

    def __init__(self, model: Model, params: ContextParams, ledger: VramLedger, *, max_contexts: int = 2,
                 context_bytes: int | None = None, host_pool: HostPool | None = None, name: str = "stager") -> None:
        if not isinstance(params, ContextParams):
            raise InvalidArgument(f"a stager needs ContextParams, got {shown(params)}")
        if params.n_seq_max != 1:
            raise InvalidArgument(f"staging contexts hold one agent: n_seq_max must be 1, got {params.n_seq_max}")
        if not isinstance(ledger, VramLedger):
            raise InvalidArgument(f"a stager charges a VramLedger, got {shown(ledger)}")
        self.model = model
        self.params = params
        self.ledger = ledger
        self.max_contexts = check_int(max_contexts, "max_contexts", low=1, high=1024)
        self.context_bytes = (context_estimate(ModelShape.read(model.path), params.n_ctx, params.n_ubatch).total_bytes
                              if context_bytes is None else check_int(context_bytes, "context_bytes", low=0))
        self.host_pool = host_pool or default_pool()
        self.name = name
        self._lock = threading.Lock()
        self._table: SlotTable[PrefetchHandle] = SlotTable(ledger, self.max_contexts, self.context_bytes, name)
        self._active: dict[int, Slot[PrefetchHandle]] = {}  # id(ctx) -> slot, for the contexts the caller holds
        self._closed = False
        self._copy_in = ThreadPoolExecutor(1, thread_name_prefix=f"kvrt-{name}-in")
        self._copy_out = ThreadPoolExecutor(1, thread_name_prefix=f"kvrt-{name}-out")
        self._totals: Counter[str] = Counter()
        self._times = {"restore": 0.0, "exposed": 0.0, "capture": 0.0}

    # capacity ---------------------------------------------------------------------------
    def warm(self, n: int) -> int:
        """Charge and create staging contexts now until ``n`` exist (at most ``max_contexts``); returns how many.

        Raises :class:`kvrt.accounting.ledger.LedgerDenied` when the ledger refuses one (those
        made before it stay).
        """
        n = check_int(n, "n", low=0, high=self.max_contexts)
        while True:
            with self._lock:
                self._check_open()
                if len(self._table.slots) >= n:
                    return len(self._table.slots)
                slot = self._table.charge()
                slot.state = SlotState.CREATING
            try:
                ctx = Context(self.model, self.params)
            except BaseException:
                with self._lock:
                    self._table.discard(slot)
                raise
            with self._lock:
                slot.ctx, slot.state = ctx, SlotState.FREE

    # prefetch and activation ------------------------------------------------------------
    def prefetch(self, source: Snapshot | PendingSnapshot) -> PrefetchHandle:
        """Start restoring ``source`` into a staging context on the copy-in thread; returns at once.

        ``source`` may be a swap-out still in flight (the copy waits for it). Refused at
        once, changing nothing: a released snapshot, one of another model or with more
        tokens than a staging context holds (:class:`SnapshotMismatch`), no staging
        capacity (:class:`StagingFull`). Any other failure of the copy surfaces at
        :meth:`activate`.
        """
        if isinstance(source, Snapshot):
            if source.released:
                raise StagingError("cannot prefetch a released snapshot")
            diff = source.fingerprint.mismatch(self.model.fingerprint)
            if diff is not None:
                raise SnapshotMismatch(f"snapshot of model {source.fingerprint.description!r} cannot be staged for "
                                       f"{self.model.path.name!r}: {diff}")
            if source.n_tokens > self.params.n_ctx:
                raise SnapshotMismatch(f"snapshot holds {source.n_tokens} tokens but a staging context has "
                                       f"n_ctx={self.params.n_ctx}")
        elif not isinstance(source, PendingSnapshot):
            raise InvalidArgument(f"prefetch needs a Snapshot or a PendingSnapshot, got {shown(source)}")
        handle = PrefetchHandle(self, source)
        with self._lock:
            self._check_open()
            slot, after = self._table.claim(handle)
            self._totals["prefetches"] += 1
            handle._slot = slot
            handle._future = self._copy_in.submit(self._stage, handle, slot, after)
        return handle

    def _stage(self, handle: PrefetchHandle, slot: Slot[PrefetchHandle],
               after: PendingSnapshot | None) -> ActivationRecord:
        """Copy-in thread: restore ``handle``'s state into ``slot`` (owned once its drain, if any, is over)."""
        t0 = time.perf_counter()
        if after is not None:
            after._wait()
            # The capture is the swapped-out agent's, not this job's: an exception raised below keeps this
            # frame alive in the handle's future, and must not keep that snapshot (and its host buffer) with it.
            after = None
            with self._lock:
                if slot.handle is not handle:  # the drain failed: the slot's agent is active again
                    self._totals["failed"] += 1
                    raise StagingError("the staging context this prefetch waited for could not be drained "
                                       "(its agent stays active there)")
        try:
            if handle.cancelled or self._closed:
                raise PrefetchCancelled("cancelled before its copy started")
            created = slot.ctx is None
            if slot.ctx is None:
                slot.ctx = Context(self.model, self.params)
            source = handle.source
            snapshot = source.result() if isinstance(source, PendingSnapshot) else source
            t_restore = time.perf_counter()
            snapshot.restore(slot.ctx, 0)
            record = ActivationRecord(snapshot.n_tokens, snapshot.nbytes, _ms_since(t_restore), _ms_since(t0),
                                      0.0, created)
            with self._lock:
                if handle.cancelled:
                    raise PrefetchCancelled("cancelled while its copy ran")
                slot.state = SlotState.READY
                self._totals["bytes_in"] += record.nbytes
                self._times["restore"] += record.restore_ms
            return record
        except BaseException as exc:
            with self._lock:
                self._table.free(slot)
                if not isinstance(exc, PrefetchCancelled):
                    self._totals["failed"] += 1
            raise

    def activate(self, handle: PrefetchHandle, timeout: float | None = None) -> Context:
        """Wait for what is left of ``handle``'s copy and hand over its context, holding the agent.

        The agent continues at position ``n_tokens`` of sequence 0; give the context back
        with :meth:`swap_out_async`. A failed copy raises its error here (its context is
        already back in the free set); a cancelled prefetch raises :class:`PrefetchCancelled`.
        ``handle.record`` then says how long the caller waited and how long the copy took.
        """
        if not isinstance(handle, PrefetchHandle) or handle.stager is not self:
            raise StagingError(f"{shown(handle)} is not a prefetch of this stager")
        if handle.activated:
            raise StagingError(f"{handle!r} was already activated")
        if handle.cancelled:
            raise PrefetchCancelled(f"{handle!r} was cancelled")
        self._check_open()
        assert handle._future is not None and handle._slot is not None
        was_ready = handle._future.done()
        t0 = time.perf_counter()
        record = handle._future.result(timeout)
        exposed = _ms_since(t0)
        with self._lock:
            slot = handle._slot
            if handle.cancelled or slot.handle is not handle or slot.state is not SlotState.READY:
                raise PrefetchCancelled(f"{handle!r} was cancelled while it was activated")
            assert slot.ctx is not None
            slot.state, slot.handle = SlotState.ACTIVE, None
            self._active[id(slot.ctx)] = slot
            handle.activated = True
            handle.record = ActivationRecord(record.n_tokens, record.nbytes, record.restore_ms, record.stage_ms,
                                             exposed, record.created_context)
            self._totals["activations"] += 1
            self._totals["ready_at_activation"] += was_ready
            self._times["exposed"] += exposed
            return slot.ctx

    def _cancel(self, handle: PrefetchHandle) -> bool:
        with self._lock:
            if handle.activated:
                return False
            if not handle.cancelled:
                handle._cancelled.set()
                self._totals["cancelled"] += 1
                slot = handle._slot
                if slot is not None and slot.handle is handle and slot.state is SlotState.READY:
                    self._table.free(slot)  # a running or queued copy frees its slot itself when it sees the flag
            return True

    # swap-out ---------------------------------------------------------------------------
    def swap_out_async(self, ctx: Context, *, tokens: Sequence[int] | None = None) -> PendingSnapshot:
        """Capture the agent in ``ctx`` (an activated staging context) into the host pool on the copy-out thread.

        Returns at once; the caller must not use ``ctx`` afterwards. The context is emptied
        and reused once the capture is done; ``tokens`` (the ids the sequence holds) are
        hashed into the snapshot. If the capture fails, :meth:`PendingSnapshot.result`
        raises and the agent stays active in ``ctx`` (swap it out again or keep decoding).
        """
        with self._lock:
            self._check_open()
            slot = self._active.pop(id(ctx), None)
            if slot is None or slot.ctx is not ctx:
                raise StagingError(f"{shown(ctx)} is not a context this stager activated (or it was already "
                                   "swapped out)")
            slot.state = SlotState.DRAINING
            future: Future[tuple[Snapshot, SwapOutRecord]] = Future()
            slot.drain = pending = PendingSnapshot(future)
            self._copy_out.submit(self._drain, slot, future, tokens)
            return pending

    def _drain(self, slot: Slot[PrefetchHandle], future: Future[tuple[Snapshot, SwapOutRecord]],
               tokens: Sequence[int] | None) -> None:
        """Copy-out thread: capture ``slot``'s agent; free the slot (or hand it to the prefetch behind it)."""
        assert slot.ctx is not None
        t0 = time.perf_counter()
        try:
            snapshot = Snapshot.capture(slot.ctx, 0, pool=self.host_pool, tokens=tokens)
        except Exception as exc:  # noqa: BLE001 -- the agent must stay usable whatever failed
            with self._lock:
                slot.state, slot.next, slot.drain = SlotState.ACTIVE, None, None
                self._active[id(slot.ctx)] = slot
                self._totals["failed"] += 1
            future.set_exception(StagingError(f"swap-out failed, the agent stays active in its context: {exc}"))
            return
        record = SwapOutRecord(snapshot.n_tokens, snapshot.nbytes, _ms_since(t0))
        with self._lock:
            self._table.free(slot)
            slot.drain = None
            if slot.next is not None:
                slot.state, slot.handle, slot.next = SlotState.STAGING, slot.next, None
            self._totals["swap_outs"] += 1
            self._totals["bytes_out"] += record.nbytes
            self._times["capture"] += record.capture_ms
        future.set_result((snapshot, record))

    # contexts in and out of the stager ------------------------------------------------------
    def adopt(self, ctx: Context, reservation: Reservation) -> None:
        """Take in a caller's live context and its ledger charge as an activated staging context.

        So a context the stager did not create can be swapped out on the copy-out thread
        (:meth:`swap_out_async`) and then staged into. Refused, changing nothing: a context of
        another model or shape (:class:`StagingError`), the stager at ``max_contexts``
        (:class:`StagingFull`).
        """
        if ctx.closed or ctx.model is not self.model or ctx.n_ctx != self.params.n_ctx or ctx.n_seq_max != 1:
            raise StagingError(f"{shown(ctx)} is not a one-sequence context of {self.model.path.name!r} with "
                               f"n_ctx={self.params.n_ctx}")
        with self._lock:
            self._check_open()
            slot = self._table.adopt(ctx, reservation)
            self._active[id(ctx)] = slot

    def detach(self, ctx: Context) -> tuple[Context, Reservation]:
        """Hand an activated context out of the stager for good, with its ledger charge (re-own it).

        The stager holds one context fewer; a later prefetch charges and creates another.
        """
        with self._lock:
            slot = self._active.pop(id(ctx), None)
            if slot is None or slot.ctx is not ctx:
                raise StagingError(f"{shown(ctx)} is not a context this stager activated")
            return self._table.detach(slot)

    def trim(self) -> int:
        """Close the staging contexts nobody holds and give their charges back; returns the bytes released."""
        with self._lock:
            return self._table.trim() if not self._closed else 0

    # reporting and lifetime -------------------------------------------------------------
    @property
    def stats(self) -> StagerStats:
        with self._lock:
            t = self._totals
            return StagerStats(self._table.charged, t["prefetches"], t["activations"], t["ready_at_activation"],
                               t["cancelled"], t["failed"], t["swap_outs"], t["bytes_in"], t["bytes_out"],
                               self._times["restore"], self._times["exposed"], self._times["capture"])

    @property
    def held_bytes(self) -> int:
        """What the staging contexts held now are charged, together."""
        with self._lock:
            return sum(slot.reservation.nbytes for slot in self._table.slots)

    def states(self) -> dict[str, int]:
        """How many staging contexts are in each state now."""
        with self._lock:
            return self._table.counts()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StagingError(f"stager {self.name!r} is closed")

    def close(self) -> None:
        """Cancel prefetches not yet activated, finish every running copy and capture, free every context.

        Pending swap-outs complete first (their snapshots are the caller's). An agent still
        activated is dropped with its context: swap it out before closing to keep it.
        Closing twice is harmless.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in self._table.slots:
                for handle in (slot.handle, slot.next):
                    if handle is not None and not handle.cancelled:
                        handle._cancelled.set()
                        self._totals["cancelled"] += 1
        self._copy_out.shutdown(wait=True)
        self._copy_in.shutdown(wait=True)
        with self._lock:
            self._active.clear()
            self._table.close()

    def __enter__(self) -> KVStager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVStager({self.name!r}, {len(self._table.slots)}/{self.max_contexts} contexts of "
                f"{self.context_bytes} B{', closed' if self._closed else ''})")
