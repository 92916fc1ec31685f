"""The physical side of an elastic pool: pages, the idle list, and the ledger charges that follow them.

Invariants (:meth:`PageSupply.check` verifies them for :meth:`kvrt.memory.elastic.ElasticPool.check`):

* every live page is either idle here or mapped into one stripe of one tenant;
* the pool owner's :class:`Charge` equals the idle pages' bytes, and a page's bytes move
  between charges with the page (:meth:`PageSupply.move_charge`), so the ledger's total
  is the physical memory the pool holds;
* a page that cannot be had is a :class:`Shortage` (a value, not a side field): the
  caller turns it into :class:`kvrt.memory.elastic.ElasticRefusal`.

Nothing here locks: the pool calls every method under its own lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvrt.accounting.ledger import LedgerDenied, Reservation, VramLedger
from kvrt.errors import KvrtError
from kvrt.memory.vmm import DeviceOutOfMemory, PageDriver


class ElasticError(KvrtError):
    """Misuse of the pool: bad sizes, an unknown or closed tenant."""


@dataclass(frozen=True)
class Shortage:
    """Why pages could not be had: the limit that was hit (capacity, ledger or device), with its numbers.

    ``stranded``: a charge handover failed both ways, so the pages' bytes are charged to
    nobody and the pages must go back to the device.
    """

    reason: str
    stranded: bool = False


class Charge:
    """One owner's ledger reservation, kept equal to the bytes that owner holds."""

    def __init__(self, ledger: VramLedger | None, owner: str) -> None:
        self.owner = owner
        self.nbytes = 0
        self._ledger = ledger
        self._reservation: Reservation | None = ledger.try_reserve(0, owner) if ledger is not None else None

    def add(self, n: int) -> LedgerDenied | None:
        if self._ledger is not None and self._reservation is not None:
            try:
                self._ledger.resize(self._reservation, self.nbytes + n)
            except LedgerDenied as denied:
                return denied
        self.nbytes += n
        return None

    def sub(self, n: int) -> None:
        if self._ledger is not None and self._reservation is not None:
            self._ledger.resize(self._reservation, self.nbytes - n)
        self.nbytes -= n

    @property
    def ledger_bytes(self) -> int | None:
        """What the ledger holds for this owner (``None``: no ledger, or closed)."""
        return self._reservation.nbytes if self._reservation is not None else None

    def close(self) -> None:
        if self._ledger is not None and self._reservation is not None:
            self._ledger.release(self._reservation)
            self._reservation = None


@dataclass(eq=False)
class Page:
    """One physical page: the driver's handle and when it was last parked idle."""

    handle: Any
    parked_at: float = 0.0


class PageSupply:
    """Creates, parks and releases pages of ``driver``; counts every driver call it makes."""

    def __init__(self, driver: PageDriver, ledger: VramLedger | None, owner: str, capacity_pages: int | None) -> None:
        self.driver = driver
        self.page_bytes = int(driver.page_bytes)
        self.ledger = ledger
        self.capacity_pages = capacity_pages
        self.charge = Charge(ledger, owner)
        self.live = 0
        self.created = self.released = self.maps = self.unmaps = 0
        self._idle: list[Page] = []

    def new_charge(self, owner: str) -> Charge:
        return Charge(self.ledger, owner)

    # pages in and out of existence ------------------------------------------------------
    def create(self) -> Page | Shortage:
        """A new page charged to the pool, or the :class:`Shortage` that prevented it (nothing changed)."""
        if self.capacity_pages is not None and self.live >= self.capacity_pages:
            return Shortage(f"pool capacity of {self.capacity_pages} pages is in use")
        denied = self.charge.add(self.page_bytes)
        if denied is not None:
            return Shortage(str(denied))
        try:
            handle = self.driver.create_page()
        except DeviceOutOfMemory as exc:
            self.charge.sub(self.page_bytes)
            return Shortage(f"device out of memory ({exc})")
        except BaseException:
            self.charge.sub(self.page_bytes)
            raise
        self.live += 1
        self.created += 1
        return Page(handle)

    def destroy(self, page: Page) -> None:
        """Release an unmapped, uncharged page to the driver."""
        self.driver.release_page(page.handle)
        self.live -= 1
        self.released += 1

    # mapping ----------------------------------------------------------------------------
    def map_page(self, va: int, page: Page) -> None:
        """Map ``page`` at ``va`` with read-write access; on failure nothing stays mapped."""
        self.driver.map_page(va, page.handle)
        try:
            self.driver.set_access(va, self.page_bytes)
        except BaseException:
            self.driver.unmap_page(va)
            raise
        self.maps += 1

    def unmap_page(self, va: int) -> None:
        self.driver.unmap_page(va)
        self.unmaps += 1

    # charges ----------------------------------------------------------------------------
    def move_charge(self, src: Charge, dst: Charge, nbytes: int) -> Shortage | None:
        """Hand ``nbytes`` from ``src`` to ``dst``; ``None`` when moved, else why not (``stranded``: src lost them)."""
        if dst.add(nbytes) is None:
            src.sub(nbytes)
            return None
        src.sub(nbytes)  # the bytes being handed over may be what blocks dst
        if (denied := dst.add(nbytes)) is None:
            return None
        return Shortage(str(denied), stranded=src.add(nbytes) is not None)

    def park(self, pages: list[Page], holder: Charge) -> None:
        """Make unmapped ``pages`` idle, moving their charge from ``holder``; if the ledger refuses, destroy them."""
        nbytes = len(pages) * self.page_bytes
        shortage = self.move_charge(holder, self.charge, nbytes)
        if shortage is None:
            self._idle.extend(pages)
            return
        if not shortage.stranded:
            holder.sub(nbytes)
        for page in pages:
            self.destroy(page)

    # the idle list ----------------------------------------------------------------------
    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def pop(self, n: int) -> list[Page]:
        """Take ``n`` idle pages (the caller checked there are that many)."""
        return [self._idle.pop() for _ in range(n)]

    def pop_one(self) -> Page | None:
        return self._idle.pop() if self._idle else None

    def give_back(self, pages: list[Page]) -> None:
        """Return pages that are still charged to the pool to the idle list."""
        self._idle.extend(pages)

    def stock(self, n: int) -> bool:
        """Create pages until ``n`` are idle; ``False`` when a shortage stopped it first."""
        while len(self._idle) < n:
            page = self.create()
            if isinstance(page, Shortage):
                return False
            self._idle.append(page)
        return True

    def add_idle(self) -> bool:
        """Create one page ahead and park it; ``False`` on a shortage."""
        page = self.create()
        if isinstance(page, Shortage):
            return False
        page.parked_at = time.monotonic()
        self._idle.append(page)
        return True

    def release_parked(self, keep_pages: int, park_s: float) -> None:
        """Release the oldest idle pages beyond ``keep_pages`` that have been parked for ``park_s``."""
        excess = len(self._idle) - keep_pages
        if excess <= 0:
            return
        now = time.monotonic()
        self._idle.sort(key=lambda p: p.parked_at)  # oldest first
        old = [p for p in self._idle[:excess] if now - p.parked_at >= park_s]
        del self._idle[:len(old)]
        self._release(old)

    def trim(self) -> int:
        """Release every idle page to the device now; returns how many."""
        pages, self._idle = self._idle, []
        self._release(pages)
        return len(pages)

    def _release(self, pages: list[Page]) -> None:
        for page in pages:
            self.charge.sub(self.page_bytes)
            self.destroy(page)

    def check(self, mapped: list[Page]) -> None:
        """Verify the module's invariants given every page mapped into a tenant; :class:`ElasticError` if broken."""
        pages = self._idle + mapped
        seen: set[int] = set()
        for page in pages:
            if id(page) in seen:
                raise ElasticError(f"page {page.handle!r} is held twice")
            seen.add(id(page))
        if len(pages) != self.live:
            raise ElasticError(f"{len(pages)} pages are accounted for but {self.live} exist (leak)")
        if self.ledger is not None and self.charge.ledger_bytes != len(self._idle) * self.page_bytes:
            raise ElasticError(f"pool ledger holds {self.charge.ledger_bytes} B for "
                               f"{len(self._idle)} idle pages of {self.page_bytes} B")
