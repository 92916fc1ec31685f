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

import threading
from dataclasses import KW_ONLY, dataclass

from kvrt.accounting.ledger import VramLedger
from kvrt.errors import KvrtError
from kvrt.memory.elastic_supply import ElasticError, Page, PageSupply, Shortage
from kvrt.memory.elastic_tenant import Tenant
from kvrt.memory.vmm import Fence, PageDriver

__all__ = ["DEFAULT_POOL_OWNER", "ElasticError", "ElasticPool", "ElasticRefusal", "PoolPolicy", "PoolStats", "Tenant"]

DEFAULT_POOL_OWNER = "pool:elastic"


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


@dataclass(frozen=True)
class PoolPolicy:
    """How :meth:`ElasticPool.maintain` keeps driver calls off the critical path (see the module docstring)."""

    idle_target_pages: int = 0
    idle_max_pages: int = 64
    park_s: float = 1.0
    map_ahead_stripes: int = 1
    background_map: bool = True

    def __post_init__(self) -> None:
        if (self.idle_target_pages < 0 or self.idle_max_pages < self.idle_target_pages or self.map_ahead_stripes < 0
                or self.park_s < 0):
            raise ElasticError(
                f"need 0 <= idle_target_pages ({self.idle_target_pages}) <= idle_max_pages ({self.idle_max_pages}), "
                f"map_ahead_stripes >= 0 ({self.map_ahead_stripes}) and park_s >= 0 ({self.park_s})")


@dataclass(eq=False)
class ElasticRefusal(KvrtError):
    """A tenant could not grow: no page was left (capacity, ledger or device). Nothing changed."""

    tenant: str
    reason: str
    _: KW_ONLY
    requested_bytes: int
    committed_bytes: int
    max_bytes: int
    pages_needed: int
    stats: PoolStats

    def __post_init__(self) -> None:
        stats = self.stats
        super().__init__(
            f"elastic tenant {self.tenant!r} cannot grow to {self.requested_bytes} B per segment "
            f"(holds {self.committed_bytes} B, max {self.max_bytes} B, needs {self.pages_needed} more pages of "
            f"{stats.page_bytes} B): {self.reason} [pool: {stats.live_pages} pages live, {stats.idle_pages} idle, "
            f"{stats.mapped_pages} mapped, capacity {stats.capacity_pages}]"
        )


class ElasticPool:
    """Physical pages shared by tenants: the policy over a :class:`PageSupply` and its tenants.

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
        self.policy = PoolPolicy(idle_target_pages, idle_max_pages, park_s, map_ahead_stripes, background_map)
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ElasticError(f"capacity_bytes must be non-negative, got {capacity_bytes}")
        self.driver = driver
        self.page_bytes = int(driver.page_bytes)
        self.capacity_pages = None if capacity_bytes is None else capacity_bytes // self.page_bytes
        self.owner = owner
        self._supply = PageSupply(driver, ledger, owner, self.capacity_pages)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._tenants: dict[str, Tenant] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._thread_error: BaseException | None = None
        self.closed = False

    # tenants ------------------------------------------------------------------------
    def add_tenant(self, name: str, segment_bytes: int, *, segments: int = 1,
                   map_ahead_stripes: int | None = None) -> Tenant:
        """Reserve virtual space for ``segments`` x ``segment_bytes`` (rounded up to pages); maps nothing."""
        if segments <= 0 or segment_bytes <= 0:
            raise ElasticError(f"tenant {name!r} needs positive segments and segment_bytes, "
                               f"got {segments} x {segment_bytes}")
        segment_bytes = -(-segment_bytes // self.page_bytes) * self.page_bytes
        with self._lock:
            self._check_open()
            if name in self._tenants:
                raise ElasticError(f"the pool already has a tenant named {name!r}")
            charge = self._supply.new_charge(f"elastic:{name}")
            try:
                va = self.driver.reserve(segments * segment_bytes)
            except BaseException:
                charge.close()
                raise
            ahead = self.policy.map_ahead_stripes if map_ahead_stripes is None else map_ahead_stripes
            tenant = Tenant(self, self._supply, name, segments, segment_bytes, va, charge, ahead)
            self._tenants[name] = tenant
            return tenant

    def remove_tenant(self, tenant: Tenant, fence: Fence | None = None) -> None:
        """Return every page of ``tenant`` to the pool (after ``fence``) and free its range."""
        with self._lock:
            self._check_tenant(tenant)
            self.shrink(tenant, 0, fence)
            tenant.retire()
            del self._tenants[tenant.name]

    @property
    def tenants(self) -> list[Tenant]:
        with self._lock:
            return list(self._tenants.values())

    # growth and shrink ----------------------------------------------------------------
    def grow(self, tenant: Tenant, nbytes: int) -> None:
        """Back at least ``nbytes`` of every segment of ``tenant`` (:meth:`Tenant.grow_to`)."""
        if nbytes < 0:
            raise ElasticError(f"tenant {tenant.name!r}: size must be non-negative, got {nbytes}")
        need = -(-nbytes // self.page_bytes)
        with self._lock:
            self._check_tenant(tenant)
            missing = need - tenant.mapped_stripes
            if nbytes > tenant.segment_bytes:
                raise self._refusal(tenant, nbytes, missing,
                                    f"exceeds the tenant's maximum of {tenant.segment_bytes} B per segment")
            if missing > 0:  # else the fast path: already mapped (ahead, or not yet unmapped)
                pages = self._gather(missing * tenant.segments, exclude=tenant)
                shortage = pages if isinstance(pages, Shortage) else tenant.map_stripes(pages)
                if shortage is not None:
                    raise self._refusal(tenant, nbytes, missing * tenant.segments, shortage.reason)
            tenant.commit(need)
            self._wake.notify()

    def shrink(self, tenant: Tenant, nbytes: int, fence: Fence | None = None) -> None:
        """Keep ``nbytes`` per segment of ``tenant``; the rest returns after ``fence`` (:meth:`Tenant.shrink_to`)."""
        if nbytes < 0:
            raise ElasticError(f"tenant {tenant.name!r}: size must be non-negative, got {nbytes}")
        keep = -(-nbytes // self.page_bytes)
        with self._lock:
            self._check_tenant(tenant)
            if not tenant.release(keep, fence):
                return
            if self._thread is None:
                tenant.reclaim()
            else:
                self._wake.notify()

    def _gather(self, n: int, exclude: Tenant) -> list[Page] | Shortage:
        """``n`` idle pages (charged to the pool), stealing unused stripes if need be; else why not, nothing taken."""
        got: list[Page] = []
        while len(got) < n:
            if (page := self._supply.pop_one()) is not None:
                got.append(page)
            elif not isinstance(created := self._supply.create(), Shortage):
                got.append(created)
            elif not (self._steal(exclude, wait=False) or self._steal(exclude, wait=True)):
                self._supply.give_back(got[::-1])
                return created
        return got

    def _steal(self, exclude: Tenant, *, wait: bool) -> bool:
        """Unmap one uncommitted stripe of another tenant (growing tenants last) into the idle list."""
        others = sorted((t for t in self._tenants.values() if t is not exclude), key=lambda t: t.growing)
        return any(tenant.give_up_top(wait=wait) for tenant in others)

    # background work --------------------------------------------------------------------
    def maintain(self) -> None:
        """One pass of the off-critical-path work: reclaim, map ahead, top up, release parked."""
        with self._lock:
            self._check_open()
            tenants = list(self._tenants.values())
        for tenant in tenants:
            with self._lock:
                if not tenant.closed:
                    tenant.reclaim()
        if self.policy.background_map:
            for tenant in tenants:
                self._map_ahead(tenant)
        while True:
            with self._lock:
                if self._supply.idle_count >= self.policy.idle_target_pages or not self._supply.add_idle():
                    break
        with self._lock:
            self._supply.release_parked(self.policy.idle_max_pages, self.policy.park_s)

    def _map_ahead(self, tenant: Tenant) -> None:
        with self._lock:
            if tenant.closed or not tenant.growing:
                return
            while tenant.mapped_stripes < tenant.map_ahead_target():
                if not self._supply.stock(tenant.segments):
                    return
                if tenant.map_stripes(self._supply.pop(tenant.segments)) is not None:
                    return

    def trim(self) -> int:
        """Release every idle page to the device now; returns how many."""
        with self._lock:
            return self._supply.trim()

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
        self._supply.charge.close()
        self.closed = True

    def __enter__(self) -> ElasticPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # introspection ------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self._lock:
            tenants = self._tenants.values()
            supply = self._supply
            return PoolStats(self.page_bytes, supply.live, supply.idle_count,
                             sum(t.mapped_stripes * t.segments for t in tenants),
                             sum(t.committed_stripes * t.segments for t in tenants), len(self._tenants),
                             self.capacity_pages, supply.created, supply.released, supply.maps, supply.unmaps)

    def check(self) -> PoolStats:
        """Verify the ownership and accounting invariants; raises :class:`ElasticError` naming the first broken one."""
        with self._lock:
            mapped = [page for tenant in self._tenants.values() for page in tenant.check()]
            self._supply.check(mapped)
            ranges = sorted((t.va, t.va + t.total_bytes, t.name) for t in self._tenants.values())
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
