"""ElasticPool: ownership, accounting, refusals and the fence rule, on the host driver (and on CUDA)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from kvrt.accounting.ledger import VramLedger
from kvrt.memory.elastic import ElasticError, ElasticPool, ElasticRefusal
from kvrt.memory.vmm import HostDriver

PAGE = 4096


class ManualFence:
    """Stands for an event after submitted work: not done until the work "finishes"."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.finished = True  # waiting on submitted work always ends


def make_pool(*, capacity_pages: int | None = None, ledger_pages: int | None = None, device_pages: int | None = None,
              **kwargs) -> tuple[ElasticPool, HostDriver, VramLedger | None]:
    driver = HostDriver(PAGE, capacity_pages=device_pages)
    ledger = VramLedger(capacity_bytes=ledger_pages * PAGE) if ledger_pages is not None else None
    capacity = capacity_pages * PAGE if capacity_pages is not None else None
    return ElasticPool(driver, ledger=ledger, capacity_bytes=capacity, **kwargs), driver, ledger


def fill(tenant, value: int) -> None:
    """Write ``value`` over the committed prefix of every segment."""
    n = tenant.committed_bytes
    for segment in range(tenant.segments):
        tenant.view(segment, (n,), np.uint8)[:] = value


def holds(tenant, value: int) -> bool:
    n = tenant.committed_bytes
    return all(bool((tenant.view(s, (n,), np.uint8) == value).all()) for s in range(tenant.segments))


def test_grow_maps_only_what_is_committed_and_shrink_returns_pages():
    pool, driver, ledger = make_pool(ledger_pages=64, map_ahead_stripes=0)
    a = pool.add_tenant("a", 8 * PAGE, segments=2)
    assert driver.mapped_pages == 0 and a.mapped_bytes == 0
    a.grow_to(PAGE + 1)  # two pages per segment
    assert a.committed_bytes == 2 * PAGE and driver.mapped_pages == 4
    assert ledger.snapshot().by_owner["elastic:a"] == 4 * PAGE
    a.shrink_to(0)  # the host fence is done at once: unmapped and parked idle
    stats = pool.check()
    assert driver.mapped_pages == 0 and stats.idle_pages == 4 and stats.live_pages == 4
    assert ledger.snapshot().by_owner == {"pool:elastic": 4 * PAGE, "elastic:a": 0}
    pool.close()
    assert driver.live_pages == 0 and driver.live_ranges == 0 and ledger.allocated_bytes == 0


def test_pages_freed_by_one_tenant_serve_another_without_new_pages():
    pool, driver, _ = make_pool(capacity_pages=4, map_ahead_stripes=0)
    a = pool.add_tenant("a", 4 * PAGE)
    b = pool.add_tenant("b", 4 * PAGE)
    a.grow_to(4 * PAGE)
    with pytest.raises(ElasticRefusal) as refused:
        b.grow_to(PAGE)
    assert refused.value.tenant == "b" and "capacity of 4 pages" in str(refused.value)
    assert b.committed_bytes == 0 and pool.check().mapped_pages == 4
    a.shrink_to(PAGE)
    b.grow_to(3 * PAGE)
    assert pool.stats().created == 4 and driver.live_pages == 4
    pool.close()


def test_refusals_name_the_limit_and_change_nothing():
    pool, _, ledger = make_pool(ledger_pages=3, map_ahead_stripes=0)
    a = pool.add_tenant("a", 2 * PAGE, segments=2)
    with pytest.raises(ElasticRefusal, match="maximum of 8192 B"):
        a.grow_to(2 * PAGE + 1)
    with pytest.raises(ElasticRefusal, match="VRAM ledger denied"):
        a.grow_to(2 * PAGE)  # 4 pages > 3 in the ledger
    assert a.mapped_bytes == 0 and pool.check().live_pages == ledger.allocated_bytes // PAGE
    pool.close()


def test_device_out_of_memory_is_a_refusal():
    pool, _, _ = make_pool(device_pages=2, map_ahead_stripes=0)
    a = pool.add_tenant("a", 8 * PAGE)
    a.grow_to(2 * PAGE)
    with pytest.raises(ElasticRefusal, match="device out of memory"):
        a.grow_to(3 * PAGE)
    assert a.committed_bytes == 2 * PAGE
    pool.check()
    pool.close()


def test_unmap_waits_for_the_fence_and_regrowth_reuses_the_mapping():
    pool, driver, _ = make_pool(map_ahead_stripes=0)
    a = pool.add_tenant("a", 4 * PAGE)
    a.grow_to(4 * PAGE)
    fill(a, 7)
    fence = ManualFence()
    a.shrink_to(PAGE, fence)
    pool.maintain()
    assert driver.mapped_pages == 4, "pages a kernel may still read were unmapped before its fence"
    maps = pool.stats().maps
    a.grow_to(3 * PAGE)  # still mapped: reused in place, no driver call, data intact
    assert pool.stats().maps == maps and holds(a, 7)
    later = ManualFence()
    a.shrink_to(PAGE, later)
    fence.finished = True
    pool.maintain()
    assert driver.mapped_pages == 4, "a later undone fence still protects the stripes"
    later.finished = True
    pool.maintain()
    assert driver.mapped_pages == 1
    pool.close()


def test_a_growing_tenant_takes_pages_another_tenant_still_fences_only_after_waiting():
    pool, driver, _ = make_pool(capacity_pages=2, map_ahead_stripes=0)
    a = pool.add_tenant("a", 2 * PAGE)
    b = pool.add_tenant("b", 2 * PAGE)
    a.grow_to(2 * PAGE)
    fence = ManualFence()
    a.shrink_to(0, fence)
    b.grow_to(2 * PAGE)  # must wait on a's fence before unmapping a's pages
    assert fence.finished and a.mapped_bytes == 0 and b.committed_bytes == 2 * PAGE
    pool.check()
    pool.close()


def test_map_ahead_makes_crossing_a_page_boundary_free_of_driver_calls():
    pool, _, _ = make_pool(map_ahead_stripes=2, idle_target_pages=4, idle_max_pages=4)
    pool.maintain()
    assert pool.stats().idle_pages == 4
    a = pool.add_tenant("a", 16 * PAGE)
    a.grow_to(1)
    pool.maintain()
    assert a.mapped_bytes == 3 * PAGE
    before = pool.stats()
    a.grow_to(3 * PAGE)
    after = pool.stats()
    assert (after.maps, after.created) == (before.maps, before.created)
    pool.close()


def test_parked_pages_are_released_only_above_the_idle_maximum():
    pool, driver, _ = make_pool(map_ahead_stripes=0, idle_max_pages=2, park_s=0.0)
    a = pool.add_tenant("a", 8 * PAGE)
    a.grow_to(8 * PAGE)
    a.shrink_to(0)
    assert pool.stats().idle_pages == 8
    pool.maintain()
    assert pool.stats().idle_pages == 2 and driver.live_pages == 2
    pool.close()


def test_thousands_of_grow_shrink_cycles_leak_nothing():
    pool, driver, ledger = make_pool(ledger_pages=40, capacity_pages=36, map_ahead_stripes=1,
                                     idle_target_pages=2, idle_max_pages=6, park_s=0.0)
    tenants = [pool.add_tenant(f"t{i}", 12 * PAGE, segments=i + 1) for i in range(3)]
    rng = np.random.default_rng(0)
    refusals = 0
    for step in range(3000):
        tenant = tenants[step % 3]
        size = int(rng.integers(0, 12 * PAGE + 1))
        try:
            tenant.grow_to(size)
        except ElasticRefusal:
            refusals += 1
        tenant.shrink_to(int(rng.integers(0, size + 1)))
        if step % 7 == 0:
            pool.maintain()
        if step % 97 == 0:
            stats = pool.check()
            assert driver.live_pages == stats.live_pages == ledger.allocated_bytes // PAGE
            assert driver.mapped_pages == stats.mapped_pages
    assert refusals > 0  # the cap was actually reached
    pool.close()
    assert driver.live_pages == 0 and driver.live_ranges == 0 and ledger.allocated_bytes == 0


def test_filler_thread_maps_ahead_in_the_background():
    pool, _, _ = make_pool(map_ahead_stripes=1)
    a = pool.add_tenant("a", 8 * PAGE)
    pool.start(interval_s=0.001)
    try:
        a.grow_to(PAGE)
        done = threading.Event()
        for _ in range(2000):  # bounded wait for the filler; not a timing assertion
            if a.mapped_bytes == 2 * PAGE:
                done.set()
                break
            done.wait(0.001)
        assert done.is_set()
    finally:
        pool.stop()
    pool.check()
    pool.close()


def test_misuse_is_an_error():
    pool, _, _ = make_pool()
    a = pool.add_tenant("a", PAGE)
    with pytest.raises(ElasticError, match="already has a tenant"):
        pool.add_tenant("a", PAGE)
    with pytest.raises(ElasticError, match="non-negative"):
        a.grow_to(-1)
    a.close()
    with pytest.raises(ElasticError, match="not open"):
        a.grow_to(PAGE)
    pool.close()
    with pytest.raises(ElasticError, match="closed"):
        pool.add_tenant("b", PAGE)


class PoolMachine(RuleBasedStateMachine):
    """Random tenants growing, shrinking (with fences that finish later) and leaving."""

    tenants = Bundle("tenants")

    @initialize(capacity=st.integers(2, 24), ledger=st.integers(2, 24), ahead=st.integers(0, 2),
                idle=st.integers(0, 3), background_map=st.booleans())
    def setup(self, capacity, ledger, ahead, idle, background_map):
        self.pool, self.driver, self.ledger = make_pool(
            capacity_pages=capacity, ledger_pages=ledger, map_ahead_stripes=ahead, idle_target_pages=idle,
            idle_max_pages=idle + 2, park_s=0.0, background_map=background_map)
        self.fences: list[ManualFence] = []
        self.fenced: list[tuple[object, ManualFence, int]] = []  # (tenant, fence, bytes per segment it covers)
        self.patterns: dict[str, int] = {}
        self.count = 0

    @rule(target=tenants, segments=st.integers(1, 3), stripes=st.integers(1, 6))
    def add(self, segments, stripes):
        self.count += 1
        tenant = self.pool.add_tenant(f"t{self.count}", stripes * PAGE, segments=segments)
        self.patterns[tenant.name] = self.count % 250 + 1
        return tenant

    @rule(tenant=tenants, size=st.integers(0, 7 * PAGE))
    def grow(self, tenant, size):
        if tenant.closed:
            return
        before = (tenant.committed_bytes, tenant.mapped_bytes)
        try:
            tenant.grow_to(size)
        except ElasticRefusal:
            assert (tenant.committed_bytes, tenant.mapped_bytes) == before
            return
        assert tenant.committed_bytes >= size
        fill(tenant, self.patterns[tenant.name])

    @rule(tenant=tenants, fraction=st.floats(0, 1), fenced=st.booleans())
    def shrink(self, tenant, fraction, fenced):
        if tenant.closed:
            return
        fence = ManualFence() if fenced else None
        size = int(tenant.committed_bytes * fraction)
        if fence is not None:
            self.fences.append(fence)
            if -(-size // PAGE) * PAGE < tenant.committed_bytes:  # a no-op shrink registers no fence
                self.fenced.append((tenant, fence, tenant.committed_bytes))
        tenant.shrink_to(size, fence)

    @precondition(lambda self: self.fences)
    @rule(index=st.integers(0, 100))
    def finish_work(self, index):
        self.fences.pop(index % len(self.fences)).finished = True

    @rule()
    def maintain(self):
        self.pool.maintain()

    @rule(tenant=consumes(tenants))
    def remove(self, tenant):
        if not tenant.closed:
            tenant.close()

    @invariant()
    def consistent(self):
        stats = self.pool.check()  # no page twice, none leaked, ledger == mapped/idle, no overlap
        assert self.driver.live_pages == stats.live_pages
        assert self.driver.mapped_pages == stats.mapped_pages
        assert self.ledger.allocated_bytes == stats.live_pages * PAGE
        for tenant, fence, covered in self.fenced:  # the fence rule: read pages stay mapped until it is done
            if not fence.finished and not tenant.closed:
                assert tenant.mapped_bytes >= covered * tenant.segments
        for tenant in self.pool.tenants:  # isolation: nobody else's traffic touched a committed prefix
            assert holds(tenant, self.patterns[tenant.name])

    def teardown(self):
        self.pool.close()
        assert self.driver.live_pages == 0 and self.driver.live_ranges == 0
        assert self.ledger.allocated_bytes == 0


TestPoolMachine = PoolMachine.TestCase


@pytest.mark.gpu
def test_cuda_pool_grows_shrinks_and_views_as_cupy():
    import cupy

    from kvrt.memory.vmm import CudaDriver

    driver = CudaDriver()
    ledger = VramLedger()
    page = driver.page_bytes
    with ElasticPool(driver, ledger=ledger, idle_target_pages=2, map_ahead_stripes=1) as pool:
        a = pool.add_tenant("a", 64 * page, segments=2)
        b = pool.add_tenant("b", 64 * page)
        a.grow_to(3 * page)
        b.grow_to(page)
        va = a.view(1, (3 * page // 4,), cupy.float32)
        va[:] = cupy.arange(va.size, dtype=cupy.float32)
        vb = b.view(0, (page // 4,), cupy.float32)
        vb[:] = -1
        assert bool((va == cupy.arange(va.size, dtype=cupy.float32)).all())  # exact below 2**24
        a.shrink_to(page)  # fence: an event on the current stream
        pool.maintain()
        b.grow_to(8 * page)
        assert bool((vb == -1).all())
        assert bool((va[: page // 4] == cupy.arange(page // 4, dtype=cupy.float32)).all())
        stats = pool.check()
        assert ledger.snapshot().by_owner["elastic:b"] == b.mapped_bytes
        assert stats.live_pages * page == ledger.allocated_bytes
        for _ in range(500):
            a.grow_to(20 * page)
            a.shrink_to(0)
        pool.check()
    assert ledger.allocated_bytes == 0


def test_filler_thread_racing_grow_and_shrink_keeps_the_invariants():
    pool, driver, ledger = make_pool(capacity_pages=30, ledger_pages=32, map_ahead_stripes=2, idle_target_pages=3,
                                     idle_max_pages=5, park_s=0.0)
    tenants = [pool.add_tenant(f"t{i}", 10 * PAGE, segments=2) for i in range(3)]
    rng = np.random.default_rng(7)
    pool.start(interval_s=0.0005)
    try:
        for step in range(2000):
            tenant = tenants[step % 3]
            try:
                tenant.grow_to(int(rng.integers(0, 10 * PAGE + 1)))
            except ElasticRefusal:
                pass
            fill(tenant, step % 3 + 1)
            tenant.shrink_to(int(rng.integers(0, tenant.committed_bytes + 1)))
            assert holds(tenant, step % 3 + 1)
    finally:
        pool.stop()
    stats = pool.check()
    assert driver.live_pages == stats.live_pages == ledger.allocated_bytes // PAGE
    pool.close()
    assert driver.live_pages == 0 and ledger.allocated_bytes == 0
