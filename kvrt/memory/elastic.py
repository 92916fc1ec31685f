"""Elastic KV memory: physical pages mapped into tenants' virtual ranges only as they grow.

kvcached's idea for kvrt. A *tenant* (a model's KV cache, a custom runtime's buffer)
reserves one contiguous virtual range big enough for its maximum, split into
``segments`` equal parts (a KV cache has one K and one V segment per layer). It grows
and shrinks by *stripes*: one physical page at the same index of every segment, so
each segment stays a plain array whose first ``committed_bytes`` are backed and kernels
use pointer arithmetic, no page table. Pages unmapped from one tenant go to an idle
list that every tenant of the pool draws from.

Ownership and accounting (what :meth:`ElasticPool.check` verifies):

* every physical page is in exactly one place: the idle list, or one stripe slot of one
  tenant;
* the ledger holds, per tenant, exactly the bytes mapped into its range, and for the
  pool's own owner exactly the idle pages' bytes (they occupy the device too), so the
  ledger's total equals the physical memory the pool holds;
* a tenant that cannot get a page gets :class:`ElasticRefusal` with the numbers; its
  state is unchanged.

Keeping driver calls off the critical path (``maintain``, run by the filler thread):
idle pages are created ahead (``idle_target_pages``); a growing tenant gets
``map_ahead_stripes`` stripes mapped beyond what it committed, so crossing a page
boundary is bookkeeping only; unmapped pages are parked idle (map again costs no
``cuMemCreate``) and released only when more than ``idle_max_pages`` have been parked
for ``park_s``.

The rule that keeps mapping changes from racing kernels (kvcached hit both halves of
it: issue #463, unmap before in-flight batches finished; PR #465, page-table edits under
running kernels):

1. kernels read only a tenant's committed prefix, and the prefix grows only after the
   map and access calls for it returned; mapping ahead touches addresses above the
   prefix, which nothing reads. ``ElasticPool(background_map=False)`` keeps even that
   off the filler thread (it then only creates pages), for devices where page-table
   edits disturb running kernels.
2. shrinking takes a :class:`kvrt.memory.vmm.Fence` recorded *after the last work that reads
   the released stripes was submitted* (by default an event on the current stream at
   the call); a stripe above the prefix is unmapped only once every fence that
   protects it is done. The caller must not launch work on those positions after
   ``shrink_to`` (the CPU-side half of #463). Regrowing over a stripe that is still
   mapped reuses it in place, with no driver call.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvrt.errors import KvrtError
from kvrt.memory.vmm import DeviceOutOfMemory, Fence, PageDriver
from kvrt.serve.ledger import LedgerDenied, Reservation, VramLedger

DEFAULT_POOL_OWNER = "pool:elastic"


class ElasticError(KvrtError):
    """Misuse of the pool: bad sizes, an unknown or closed tenant."""


@dataclass(frozen=True)
class PoolStats:
    """Pages by state (one page is ``page_bytes``) and the driver calls made so far."""

    page_bytes: int
    live_pages: int
    idle_pages: int
    mapped_pages: int
    committed_pages: int
    tenants: int
    capacity_pages: int | None
    created: int
    released: int
    maps: int
    unmaps: int


class ElasticRefusal(KvrtError):
    """A tenant could not grow: no page was left (capacity, ledger or device). Nothing changed."""

    def __init__(self, tenant: str, reason: str, *, requested_bytes: int, committed_bytes: int,
                 max_bytes: int, pages_needed: int, stats: PoolStats) -> None:
        self.tenant = tenant
        self.reason = reason
        self.requested_bytes = requested_bytes
        self.committed_bytes = committed_bytes
        self.max_bytes = max_bytes
        self.pages_needed = pages_needed
        self.stats = stats
        super().__init__(
            f"elastic tenant {tenant!r} cannot grow to {requested_bytes} B per segment "
            f"(holds {committed_bytes} B, max {max_bytes} B, needs {pages_needed} more pages of "
            f"{stats.page_bytes} B): {reason} [pool: {stats.live_pages} pages live, {stats.idle_pages} idle, "
            f"{stats.mapped_pages} mapped, capacity {stats.capacity_pages}]"
        )


class _Charge:
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
        return self._reservation.nbytes if self._reservation is not None else None

    def close(self) -> None:
        if self._ledger is not None and self._reservation is not None:
            self._ledger.release(self._reservation)
            self._reservation = None


@dataclass(eq=False)
class _Page:
    handle: Any
    parked_at: float = 0.0


@dataclass(eq=False)
class _Pending:
    fence: Fence
    lowest: int  # the fence protects stripes at this index and above


class Tenant:
    """One contiguous virtual range of ``segments`` × ``segment_bytes``, backed as it grows.

    Create through :meth:`ElasticPool.add_tenant`. Sizes are per segment: ``grow_to(n)``
    backs the first ``n`` bytes of every segment.
    """

    def __init__(self, pool: ElasticPool, name: str, segments: int, segment_bytes: int, va: int,
                 charge: _Charge, map_ahead_stripes: int) -> None:
        self.pool = pool
        self.name = name
        self.segments = segments
        self.segment_bytes = segment_bytes
        self.va = va
        self.map_ahead_stripes = map_ahead_stripes
        self._charge = charge
        self._stripes: list[list[_Page]] = []  # stripe index -> one page per segment
        self._committed = 0
        self._growing = False
        self._pending: list[_Pending] = []
        self.closed = False

    # sizes --------------------------------------------------------------------------
    @property
    def max_stripes(self) -> int:
        return self.segment_bytes // self.pool.page_bytes

    @property
    def committed_bytes(self) -> int:
        """Backed bytes per segment that kernels may read."""
        return self._committed * self.pool.page_bytes

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped into the whole range (what the ledger holds for this tenant)."""
        return len(self._stripes) * self.segments * self.pool.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.segments * self.segment_bytes

    def segment_va(self, segment: int) -> int:
        if not 0 <= segment < self.segments:
            raise ElasticError(f"segment {segment} is outside [0, {self.segments}) of tenant {self.name!r}")
        return self.va + segment * self.segment_bytes

    # operations ---------------------------------------------------------------------
    def grow_to(self, nbytes: int) -> None:
        """Back at least ``nbytes`` of every segment; raises :class:`ElasticRefusal`."""
        self.pool._grow(self, nbytes)

    def shrink_to(self, nbytes: int, fence: Fence | None = None) -> None:
        """Keep ``nbytes`` per segment; the rest returns to the pool once ``fence`` is done."""
        self.pool._shrink(self, nbytes, fence)

    def view(self, segment: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """An array over the start of ``segment`` (CuPy on CUDA): read only the committed part."""
        nbytes = math.prod(shape) * _itemsize(dtype)
        if nbytes > self.segment_bytes:
            raise ElasticError(f"a view of {nbytes} B does not fit segment of {self.segment_bytes} B "
                               f"of tenant {self.name!r}")
        return self.pool.driver.array(self.segment_va(segment), shape, dtype, self)

    def close(self, fence: Fence | None = None) -> None:
        self.pool.remove_tenant(self, fence)

    def __repr__(self) -> str:
        return (f"Tenant({self.name!r}, {self.segments}x{self.segment_bytes} B, committed {self.committed_bytes} B, "
                f"mapped {self.mapped_bytes} B)")


def _itemsize(dtype: Any) -> int:
    import numpy as np

    return int(np.dtype(dtype).itemsize)


class ElasticPool:
    """Physical pages shared by tenants; policy and accounting over a :class:`kvrt.memory.vmm.PageDriver`.

    ``capacity_bytes`` caps the physical memory the pool may hold (``None``: the ledger
    and the device decide). ``ledger`` is charged as the module docstring says.
    ``start()`` runs :meth:`maintain` on a filler thread; without it, call
    :meth:`maintain` yourself (tests do, to stay deterministic).
    """

    def __init__(
        self,
        driver: PageDriver | None = None,
        *,
        ledger: VramLedger | None = None,
        owner: str = DEFAULT_POOL_OWNER,
        capacity_bytes: int | None = None,
        idle_target_pages: int = 0,
        idle_max_pages: int = 64,
        park_s: float = 1.0,
        map_ahead_stripes: int = 1,
        background_map: bool = True,
    ) -> None:
        if driver is None:
            from kvrt.memory.vmm import CudaDriver

            driver = CudaDriver()
        if idle_target_pages < 0 or idle_max_pages < idle_target_pages or map_ahead_stripes < 0 or park_s < 0:
            raise ElasticError(
                f"need 0 <= idle_target_pages ({idle_target_pages}) <= idle_max_pages ({idle_max_pages}), "
                f"map_ahead_stripes >= 0 ({map_ahead_stripes}) and park_s >= 0 ({park_s})")
        self.driver = driver
        self.page_bytes = int(driver.page_bytes)
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ElasticError(f"capacity_bytes must be non-negative, got {capacity_bytes}")
        self.capacity_pages = None if capacity_bytes is None else capacity_bytes // self.page_bytes
        self.idle_target_pages = idle_target_pages
        self.idle_max_pages = idle_max_pages
        self.park_s = park_s
        self.map_ahead_stripes = map_ahead_stripes
        self.background_map = background_map
        self.owner = owner
        self._ledger = ledger
        self._charge = _Charge(ledger, owner)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._idle: list[_Page] = []
        self._live = 0
        self._tenants: dict[str, Tenant] = {}
        self._counts = {"created": 0, "released": 0, "maps": 0, "unmaps": 0}
        self._why = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._thread_error: BaseException | None = None
        self.closed = False

    # tenants ------------------------------------------------------------------------
    def add_tenant(self, name: str, segment_bytes: int, *, segments: int = 1,
                   map_ahead_stripes: int | None = None) -> Tenant:
        """Reserve virtual space for ``segments`` × ``segment_bytes`` (rounded up to pages); maps nothing."""
        if segments <= 0 or segment_bytes <= 0:
            raise ElasticError(f"tenant {name!r} needs positive segments and segment_bytes, "
                               f"got {segments} x {segment_bytes}")
        segment_bytes = -(-segment_bytes // self.page_bytes) * self.page_bytes
        with self._lock:
            self._check_open()
            if name in self._tenants:
                raise ElasticError(f"the pool already has a tenant named {name!r}")
            charge = _Charge(self._ledger, f"elastic:{name}")
            try:
                va = self.driver.reserve(segments * segment_bytes)
            except BaseException:
                charge.close()
                raise
            ahead = self.map_ahead_stripes if map_ahead_stripes is None else map_ahead_stripes
            tenant = Tenant(self, name, segments, segment_bytes, va, charge, ahead)
            self._tenants[name] = tenant
            return tenant

    def remove_tenant(self, tenant: Tenant, fence: Fence | None = None) -> None:
        """Return every page of ``tenant`` to the pool (after ``fence``) and free its range."""
        with self._lock:
            self._check_tenant(tenant)
            self._shrink(tenant, 0, fence)
            for pending in tenant._pending:
                pending.fence.wait()
            tenant._pending.clear()
            self._unmap_above(tenant, 0)
            self.driver.free_reservation(tenant.va, tenant.total_bytes)
            tenant._charge.close()
            tenant.closed = True
            del self._tenants[tenant.name]

    @property
    def tenants(self) -> list[Tenant]:
        with self._lock:
            return list(self._tenants.values())

    # growth and shrink ----------------------------------------------------------------
    def _grow(self, tenant: Tenant, nbytes: int) -> None:
        if nbytes < 0:
            raise ElasticError(f"tenant {tenant.name!r}: size must be non-negative, got {nbytes}")
        need = -(-nbytes // self.page_bytes)
        with self._lock:
            self._check_tenant(tenant)
            if nbytes > tenant.segment_bytes:
                raise self._refusal(tenant, nbytes, need - len(tenant._stripes),
                                    f"exceeds the tenant's maximum of {tenant.segment_bytes} B per segment")
            if need <= len(tenant._stripes):  # fast path: already mapped (ahead, or not yet unmapped)
                tenant._committed = max(tenant._committed, need)
                tenant._growing = True
                self._wake.notify()
                return
            missing = need - len(tenant._stripes)
            pages = self._gather(missing * tenant.segments, exclude=tenant)
            if pages is None:
                raise self._refusal(tenant, nbytes, missing * tenant.segments, self._why)
            if not self._assign(tenant, pages):
                raise self._refusal(tenant, nbytes, missing * tenant.segments, self._why)
            tenant._committed = need
            tenant._growing = True
            self._wake.notify()

    def _shrink(self, tenant: Tenant, nbytes: int, fence: Fence | None) -> None:
        if nbytes < 0:
            raise ElasticError(f"tenant {tenant.name!r}: size must be non-negative, got {nbytes}")
        keep = -(-nbytes // self.page_bytes)
        with self._lock:
            self._check_tenant(tenant)
            tenant._growing = False
            if keep >= tenant._committed:
                return
            if tenant._stripes[keep:]:
                tenant._pending.append(_Pending(fence if fence is not None else self.driver.fence(), keep))
            tenant._committed = keep
            if self._thread is None:
                self._reclaim(tenant)
            else:
                self._wake.notify()

    # page supply ----------------------------------------------------------------------
    def _gather(self, n: int, exclude: Tenant | None) -> list[_Page] | None:
        """``n`` idle pages (charged to the pool), or ``None`` with ``self._why`` set and nothing taken."""
        got: list[_Page] = []
        while len(got) < n:
            if self._idle:
                got.append(self._idle.pop())
            elif (page := self._create()) is not None:
                got.append(page)
            elif not (self._steal(exclude, wait=False) or self._steal(exclude, wait=True)):
                self._idle.extend(reversed(got))
                return None
        return got

    def _create(self) -> _Page | None:
        if self.capacity_pages is not None and self._live >= self.capacity_pages:
            self._why = f"pool capacity of {self.capacity_pages} pages is in use"
            return None
        denied = self._charge.add(self.page_bytes)
        if denied is not None:
            self._why = str(denied)
            return None
        try:
            handle = self.driver.create_page()
        except DeviceOutOfMemory as exc:
            self._charge.sub(self.page_bytes)
            self._why = f"device out of memory ({exc})"
            return None
        except BaseException:
            self._charge.sub(self.page_bytes)
            raise
        self._live += 1
        self._counts["created"] += 1
        return _Page(handle)

    def _steal(self, exclude: Tenant | None, *, wait: bool) -> bool:
        """Unmap one uncommitted stripe of another tenant into the idle list.

        Without ``wait`` only stripes no pending fence protects; with it, wait for the
        fences of the first candidate (its work was submitted, so the wait ends).
        """
        candidates = sorted((t for t in self._tenants.values() if t is not exclude and len(t._stripes) > t._committed),
                            key=lambda t: t._growing)
        for tenant in candidates:
            top = len(tenant._stripes) - 1
            blocking = [p for p in tenant._pending if p.lowest <= top and not p.fence.done()]
            if blocking and not wait:
                continue
            for pending in blocking:
                pending.fence.wait()
            self._prune(tenant)
            self._unmap_above(tenant, top)
            return True
        return False

    def _assign(self, tenant: Tenant, pages: list[_Page]) -> bool:
        """Map ``pages`` as new stripes of ``tenant``, moving their charge from the pool."""
        nbytes = len(pages) * self.page_bytes
        outcome = self._move_charge(self._charge, tenant._charge, nbytes)
        if outcome == "denied":
            self._idle.extend(pages)
            return False
        if outcome == "lost":
            for page in pages:
                self._destroy(page)
            return False
        for start in range(0, len(pages), tenant.segments):
            stripe = pages[start:start + tenant.segments]
            index = len(tenant._stripes)
            mapped: list[int] = []
            try:
                for segment, page in enumerate(stripe):
                    va = tenant.segment_va(segment) + index * self.page_bytes
                    self.driver.map_page(va, page.handle)
                    mapped.append(va)
                    self.driver.set_access(va, self.page_bytes)
                    self._counts["maps"] += 1
            except BaseException:  # undo this stripe; earlier stripes stay (uncommitted, reclaimable)
                for va in mapped:
                    self.driver.unmap_page(va)
                self._park(pages[start:], tenant._charge)
                raise
            tenant._stripes.append(stripe)
        return True

    def _move_charge(self, src: _Charge, dst: _Charge, nbytes: int) -> str:
        """``moved``, ``denied`` (both unchanged) or ``lost`` (src gave up the bytes and could not take them back)."""
        if (denied := dst.add(nbytes)) is None:
            src.sub(nbytes)
            return "moved"
        src.sub(nbytes)  # the bytes being handed over may be what blocks dst
        if (denied := dst.add(nbytes)) is None:
            return "moved"
        self._why = str(denied)
        return "denied" if src.add(nbytes) is None else "lost"

    def _destroy(self, page: _Page) -> None:
        """Release an unmapped, uncharged page to the driver."""
        self.driver.release_page(page.handle)
        self._live -= 1
        self._counts["released"] += 1

    # returning pages --------------------------------------------------------------------
    def _prune(self, tenant: Tenant) -> None:
        tenant._pending = [p for p in tenant._pending if not p.fence.done()]

    def _safe_floor(self, tenant: Tenant) -> int:
        """Lowest stripe index that may be unmapped now (stripes go top down, so one protected stripe blocks all)."""
        self._prune(tenant)
        if any(p.lowest < len(tenant._stripes) for p in tenant._pending):
            return len(tenant._stripes)
        return tenant._committed + (tenant.map_ahead_stripes if tenant._growing else 0)

    def _reclaim(self, tenant: Tenant) -> None:
        """Unmap the stripes of ``tenant`` above its committed prefix (plus map-ahead) that are safe."""
        floor = self._safe_floor(tenant)
        if floor < len(tenant._stripes):
            self._unmap_above(tenant, floor)

    def _unmap_above(self, tenant: Tenant, floor: int) -> None:
        """Unmap stripes ``floor..`` of ``tenant`` (top down) and park their pages idle."""
        removed = tenant._stripes[floor:]
        if not removed:
            return
        now = time.monotonic()
        for index in range(len(tenant._stripes) - 1, floor - 1, -1):
            for segment, page in enumerate(tenant._stripes[index]):
                self.driver.unmap_page(tenant.segment_va(segment) + index * self.page_bytes)
                self._counts["unmaps"] += 1
                page.parked_at = now
        del tenant._stripes[floor:]
        self._park([page for stripe in removed for page in stripe], tenant._charge)

    def _park(self, pages: list[_Page], holder: _Charge) -> None:
        """Make unmapped ``pages`` idle, moving their charge from ``holder`` to the pool.

        If the ledger will not let the pool hold them, they go back to the device.
        """
        outcome = self._move_charge(holder, self._charge, len(pages) * self.page_bytes)
        if outcome == "moved":
            self._idle.extend(pages)
            return
        if outcome == "denied":
            holder.sub(len(pages) * self.page_bytes)
        for page in pages:
            self._destroy(page)

    # background work --------------------------------------------------------------------
    def maintain(self) -> None:
        """One pass of the off-critical-path work: reclaim, map ahead, top up, release parked."""
        with self._lock:
            self._check_open()
            tenants = list(self._tenants.values())
        for tenant in tenants:
            with self._lock:
                if not tenant.closed:
                    self._reclaim(tenant)
        if self.background_map:
            for tenant in tenants:
                self._map_ahead(tenant)
        while True:
            with self._lock:
                if len(self._idle) >= self.idle_target_pages or (page := self._create()) is None:
                    break
                page.parked_at = time.monotonic()
                self._idle.append(page)
        self._release_parked()

    def _map_ahead(self, tenant: Tenant) -> None:
        with self._lock:
            if tenant.closed or not tenant._growing:
                return
            target = min(tenant._committed + tenant.map_ahead_stripes, tenant.max_stripes)
            while len(tenant._stripes) < target:
                if len(self._idle) < tenant.segments:
                    pages = [p for p in (self._create() for _ in range(tenant.segments - len(self._idle)))
                             if p is not None]
                    self._idle.extend(pages)
                    if len(self._idle) < tenant.segments:
                        return
                stripe = [self._idle.pop() for _ in range(tenant.segments)]
                if not self._assign(tenant, stripe):
                    return

    def _release_parked(self) -> None:
        with self._lock:
            excess = len(self._idle) - self.idle_max_pages
            if excess <= 0:
                return
            now = time.monotonic()
            self._idle.sort(key=lambda p: p.parked_at)  # oldest first
            old = [p for p in self._idle[:excess] if now - p.parked_at >= self.park_s]
            del self._idle[:len(old)]
            for page in old:
                self._charge.sub(self.page_bytes)
                self._destroy(page)

    def trim(self) -> int:
        """Release every idle page to the device now; returns how many."""
        with self._lock:
            pages, self._idle = self._idle, []
            for page in pages:
                self._charge.sub(self.page_bytes)
                self._destroy(page)
            return len(pages)

    def start(self, interval_s: float = 0.002) -> None:
        """Run :meth:`maintain` on a daemon thread: woken by growth and shrink, else every ``interval_s``."""
        with self._lock:
            self._check_open()
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._filler, args=(interval_s,), name="kvrt-elastic-filler",
                                            daemon=True)
            self._thread.start()

    def _filler(self, interval_s: float) -> None:
        try:
            while not self._stop.is_set():
                self.maintain()
                with self._lock:
                    if not self._stop.is_set():
                        self._wake.wait(interval_s)
        except BaseException as exc:  # surfaced by stop(): a dead filler must not go unnoticed
            self._thread_error = exc

    def stop(self) -> None:
        """Stop the filler thread (re-raising what killed it, if anything did)."""
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            self._stop.set()
            self._wake.notify_all()
        thread.join()
        self._thread = None
        if self._thread_error is not None:
            error, self._thread_error = self._thread_error, None
            raise ElasticError(f"the elastic pool's filler thread failed: {error!r}") from error

    def close(self) -> None:
        """Stop the filler, remove every tenant (waiting on their fences) and release all pages."""
        if self.closed:
            return
        self.stop()
        for tenant in self.tenants:
            self.remove_tenant(tenant)
        self.trim()
        self._charge.close()
        self.closed = True

    def __enter__(self) -> ElasticPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # introspection ------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self._lock:
            mapped = sum(len(t._stripes) * t.segments for t in self._tenants.values())
            committed = sum(t._committed * t.segments for t in self._tenants.values())
            return PoolStats(self.page_bytes, self._live, len(self._idle), mapped, committed, len(self._tenants),
                             self.capacity_pages, **self._counts)

    def check(self) -> PoolStats:
        """Verify the ownership and accounting invariants; raises :class:`ElasticError` naming the first broken one."""
        with self._lock:
            seen: set[int] = set()
            pages = list(self._idle)
            ranges = []
            for tenant in self._tenants.values():
                if not 0 <= tenant._committed <= len(tenant._stripes) <= tenant.max_stripes:
                    raise ElasticError(f"{tenant.name}: committed {tenant._committed} / mapped "
                                       f"{len(tenant._stripes)} / max {tenant.max_stripes} stripes out of order")
                for stripe in tenant._stripes:
                    if len(stripe) != tenant.segments:
                        raise ElasticError(f"{tenant.name}: a stripe has {len(stripe)} pages, not {tenant.segments}")
                    pages.extend(stripe)
                if self._ledger is not None and tenant._charge.ledger_bytes != tenant.mapped_bytes:
                    raise ElasticError(f"{tenant.name}: ledger holds {tenant._charge.ledger_bytes} B but "
                                       f"{tenant.mapped_bytes} B are mapped")
                ranges.append((tenant.va, tenant.va + tenant.total_bytes, tenant.name))
            for page in pages:
                if id(page) in seen:
                    raise ElasticError(f"page {page.handle!r} is held twice")
                seen.add(id(page))
            if len(pages) != self._live:
                raise ElasticError(f"{len(pages)} pages are accounted for but {self._live} exist (leak)")
            if self._ledger is not None and self._charge.ledger_bytes != len(self._idle) * self.page_bytes:
                raise ElasticError(f"pool ledger holds {self._charge.ledger_bytes} B for "
                                   f"{len(self._idle)} idle pages of {self.page_bytes} B")
            ranges.sort()
            for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
                if start < end:
                    raise ElasticError(f"tenants {a!r} and {b!r} overlap")
            return self.stats()

    # helpers ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ElasticError("the elastic pool is closed")

    def _check_tenant(self, tenant: Tenant) -> None:
        self._check_open()
        if tenant.closed or self._tenants.get(tenant.name) is not tenant:
            raise ElasticError(f"tenant {tenant.name!r} is not open in this pool")

    def _refusal(self, tenant: Tenant, nbytes: int, pages_needed: int, reason: str) -> ElasticRefusal:
        return ElasticRefusal(tenant.name, reason, requested_bytes=nbytes, committed_bytes=tenant.committed_bytes,
                              max_bytes=tenant.segment_bytes, pages_needed=pages_needed, stats=self.stats())
