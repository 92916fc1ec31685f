"""The stager's staging contexts: a bounded set, each charged to the ledger, each held by one party at a time.

A slot is one staging context (created lazily, on the copy-in thread, the first time it
stages) and its ledger reservation. Its state says who may touch the context:

``creating``  :meth:`KVStager.warm` is creating it on the caller's thread;
``free``      nobody (empty, ready for a prefetch);
``staging``   the copy-in thread, restoring ``handle``'s state;
``ready``     nobody (restored, waiting for :meth:`KVStager.activate`);
``active``    the caller, decoding the agent;
``draining``  the copy-out thread, capturing the agent; ``next`` is a prefetch that takes the
              context over when the capture is done.

A slot is held for a prefetch through its handle (``H``: :class:`kvrt.state.staging.PrefetchHandle`),
which the table only stores (it never looks into one). A slot may also come from outside
(:meth:`SlotTable.adopt`, a caller's context and its charge) and leave with its context and
charge (:meth:`SlotTable.detach`); free slots are closed on :meth:`SlotTable.trim`.

The table is not locked itself: every method runs under its stager's lock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from kvrt.accounting.ledger import Reservation, VramLedger
from kvrt.engine.context import Context
from kvrt.errors import KvrtError
from kvrt.state.staging_records import PendingSnapshot, StagingFull

H = TypeVar("H")  # the prefetch handle that holds a slot


class SlotState(Enum):
    CREATING = "creating"
    FREE = "free"
    STAGING = "staging"
    READY = "ready"
    ACTIVE = "active"
    DRAINING = "draining"


@dataclass
class Slot(Generic[H]):
    """One staging context, its ledger charge, and who holds it now."""

    index: int
    reservation: Reservation
    ctx: Context | None = None
    state: SlotState = SlotState.FREE
    handle: H | None = None  # the prefetch that owns it while staging or ready
    next: H | None = None  # a prefetch queued behind its drain
    drain: PendingSnapshot | None = None  # the capture running while draining


class SlotTable(Generic[H]):
    """At most ``max_contexts`` slots, each charged ``context_bytes`` to ``ledger`` before it exists."""

    def __init__(self, ledger: VramLedger, max_contexts: int, context_bytes: int, name: str) -> None:
        self.ledger = ledger
        self.max_contexts = max_contexts
        self.context_bytes = context_bytes
        self.name = name
        self.slots: list[Slot[H]] = []
        self.charged = 0  # slots charged since the table was made
        self._index = 0  # the next slot's number (slots may leave the table: numbers are not reused)

    def _owner(self) -> tuple[int, str]:
        index, self._index = self._index, self._index + 1
        return index, f"staging:{self.name}#{index}"

    def charge(self) -> Slot[H]:
        """A new slot charged to the ledger; raises :class:`~kvrt.accounting.ledger.LedgerDenied`, changing nothing."""
        index, owner = self._owner()
        slot: Slot[H] = Slot(index, self.ledger.try_reserve(self.context_bytes, owner))
        self.slots.append(slot)
        self.charged += 1
        return slot

    def adopt(self, ctx: Context, reservation: Reservation) -> Slot[H]:
        """A caller's context and its ledger charge as a new ``active`` slot (the charge now the stager's).

        :class:`StagingFull` when the table is at its bound; nothing changes then.
        """
        if len(self.slots) >= self.max_contexts:
            raise StagingFull(self.counts(), self.max_contexts, None)
        index, owner = self._owner()
        self.ledger.transfer(reservation, owner)
        slot: Slot[H] = Slot(index, reservation, ctx, SlotState.ACTIVE)
        self.slots.append(slot)
        return slot

    def detach(self, slot: Slot[H]) -> tuple[Context, Reservation]:
        """Take an ``active`` slot out of the table: its context and charge become the caller's (re-own the charge)."""
        assert slot.state is SlotState.ACTIVE and slot.ctx is not None
        self.slots.remove(slot)
        return slot.ctx, slot.reservation

    def trim(self) -> int:
        """Close every ``free`` slot's context and give its charge back; returns the bytes released."""
        idle = [s for s in self.slots if s.state is SlotState.FREE]
        released = 0
        for slot in idle:
            self.slots.remove(slot)
            if slot.ctx is not None:
                slot.ctx.close()
            released += self.ledger.release(slot.reservation)
        return released

    def discard(self, slot: Slot[H]) -> None:
        """Forget a slot whose context could not be created, and its charge."""
        self.slots.remove(slot)
        self.charged -= 1
        self.ledger.release(slot.reservation)

    def claim(self, handle: H) -> tuple[Slot[H], PendingSnapshot | None]:
        """A slot for ``handle``: a free one (one with a context first), a new one, or one behind its drain
        (with the capture to wait for). :class:`StagingFull` when there is none; nothing changes then."""
        free = [s for s in self.slots if s.state is SlotState.FREE]
        if free:
            slot = min(free, key=lambda s: s.ctx is None)
            slot.state, slot.handle = SlotState.STAGING, handle
            return slot, None
        denied: KvrtError | None = None
        if len(self.slots) < self.max_contexts:
            try:
                slot = self.charge()
            except KvrtError as exc:
                denied = exc
            else:
                slot.state, slot.handle = SlotState.STAGING, handle
                return slot, None
        draining = [s for s in self.slots if s.state is SlotState.DRAINING and s.next is None]
        if draining:
            slot = draining[0]
            slot.next = handle
            return slot, slot.drain
        raise StagingFull(self.counts(), self.max_contexts, denied)

    @staticmethod
    def free(slot: Slot[H]) -> None:
        """Empty ``slot``'s context (cell metadata only) and mark it free; nobody else may be using it."""
        if slot.ctx is not None and not slot.ctx.closed and slot.ctx.seq_pos_max(0) >= 0:
            slot.ctx.seq_rm(0)
        slot.state, slot.handle = SlotState.FREE, None

    def counts(self) -> dict[str, int]:
        """How many slots are in each state."""
        return dict(Counter(s.state.value for s in self.slots))

    def close(self) -> None:
        """Free every context and give every charge back (the stager's threads have stopped)."""
        slots, self.slots = self.slots, []
        for slot in slots:
            if slot.ctx is not None:
                slot.ctx.close()
            self.ledger.release(slot.reservation)
