"""One tenant of an elastic pool: a virtual range backed by stripes of pages as it grows.

A tenant reserves ``segments`` x ``segment_bytes`` of contiguous virtual space. Stripe
``i`` is one page at offset ``i * page_bytes`` of every segment, so each segment stays a
plain array whose first ``committed_bytes`` are backed. The tenant owns its stripes,
its committed prefix, its pending fences and its ledger charge; the pool (policy) asks
it to change them through the methods below, always under the pool's lock.

Invariants: ``committed <= mapped <= max`` stripes; every stripe has one page per
segment; the tenant's charge equals its mapped bytes; a stripe at or above the
``lowest`` of an undone fence is never unmapped (kernels may still read it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

from kvrt.memory.elastic_supply import Charge, ElasticError, Page, PageSupply, Shortage
from kvrt.memory.vmm import Fence


class TenantPool(Protocol):
    """What a tenant needs of its pool (:class:`kvrt.memory.elastic.ElasticPool`, which imports this module):
    :meth:`Tenant.grow_to`, :meth:`Tenant.shrink_to` and :meth:`Tenant.close` go through the pool, which decides
    under its lock and calls the tenant's side back."""

    def grow(self, tenant: Tenant, nbytes: int) -> None: ...

    def shrink(self, tenant: Tenant, nbytes: int, fence: Fence | None = None) -> None: ...

    def remove_tenant(self, tenant: Tenant, fence: Fence | None = None) -> None: ...


@dataclass(eq=False)
class _Pending:
    fence: Fence
    lowest: int  # the fence protects stripes at this index and above


class Tenant:
    """One contiguous virtual range of ``segments`` x ``segment_bytes``, backed as it grows.

    Create through :meth:`ElasticPool.add_tenant`. Sizes are per segment: ``grow_to(n)``
    backs the first ``n`` bytes of every segment.
    """

    def __init__(self, pool: TenantPool, supply: PageSupply, name: str, segments: int, segment_bytes: int,
                 va: int, charge: Charge, map_ahead_stripes: int) -> None:
        self.pool = pool
        self.name = name
        self.segments = segments
        self.segment_bytes = segment_bytes
        self.va = va
        self.map_ahead_stripes = map_ahead_stripes
        self.closed = False
        self._supply = supply
        self._charge = charge
        self._stripes: list[list[Page]] = []  # stripe index -> one page per segment
        self._committed = 0
        self._growing = False
        self._pending: list[_Pending] = []

    # sizes --------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        return self._supply.page_bytes

    @property
    def max_stripes(self) -> int:
        return self.segment_bytes // self.page_bytes

    @property
    def mapped_stripes(self) -> int:
        return len(self._stripes)

    @property
    def committed_stripes(self) -> int:
        return self._committed

    @property
    def growing(self) -> bool:
        """Grew since its last shrink: map-ahead applies and the pool steals from it last."""
        return self._growing

    @property
    def committed_bytes(self) -> int:
        """Backed bytes per segment that kernels may read."""
        return self._committed * self.page_bytes

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped into the whole range (what the ledger holds for this tenant)."""
        return len(self._stripes) * self.segments * self.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.segments * self.segment_bytes

    def segment_va(self, segment: int) -> int:
        if not 0 <= segment < self.segments:
            raise ElasticError(f"segment {segment} is outside [0, {self.segments}) of tenant {self.name!r}")
        return self.va + segment * self.segment_bytes

    # operations ---------------------------------------------------------------------
    def grow_to(self, nbytes: int) -> None:
        """Back at least ``nbytes`` of every segment; raises :class:`kvrt.memory.elastic.ElasticRefusal`."""
        self.pool.grow(self, nbytes)

    def shrink_to(self, nbytes: int, fence: Fence | None = None) -> None:
        """Keep ``nbytes`` per segment; the rest returns to the pool once ``fence`` is done."""
        self.pool.shrink(self, nbytes, fence)

    def view(self, segment: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """An array over the start of ``segment`` (CuPy on CUDA): read only the committed part."""
        import numpy as np

        nbytes = math.prod(shape) * int(np.dtype(dtype).itemsize)
        if nbytes > self.segment_bytes:
            raise ElasticError(f"a view of {nbytes} B does not fit segment of {self.segment_bytes} B "
                               f"of tenant {self.name!r}")
        return self._supply.driver.array(self.segment_va(segment), shape, dtype, self)

    def close(self, fence: Fence | None = None) -> None:
        self.pool.remove_tenant(self, fence)

    def __repr__(self) -> str:
        return (f"Tenant({self.name!r}, {self.segments}x{self.segment_bytes} B, committed {self.committed_bytes} B, "
                f"mapped {self.mapped_bytes} B)")

    # the pool's side, called under its lock -------------------------------------------
    def commit(self, stripes: int) -> None:
        """Let kernels read the first ``stripes`` stripes (already mapped)."""
        self._committed = max(self._committed, stripes)
        self._growing = True

    def release(self, keep: int, fence: Fence | None) -> bool:
        """Shrink the committed prefix to ``keep`` stripes, the rest protected by ``fence``; ``False``: no change."""
        self._growing = False
        if keep >= self._committed:
            return False
        if self._stripes[keep:]:
            self._pending.append(_Pending(fence if fence is not None else self._supply.driver.fence(), keep))
        self._committed = keep
        return True

    def map_stripes(self, pages: list[Page]) -> Shortage | None:
        """Map ``pages`` (charged to the pool) as new stripes, moving their charge here; else why not.

        On a shortage the pages are back in the pool (or destroyed if their charge was
        stranded) and the tenant is unchanged.
        """
        supply = self._supply
        shortage = supply.move_charge(supply.charge, self._charge, len(pages) * self.page_bytes)
        if shortage is not None:
            if shortage.stranded:
                for page in pages:
                    supply.destroy(page)
            else:
                supply.give_back(pages)
            return shortage
        for start in range(0, len(pages), self.segments):
            stripe = pages[start:start + self.segments]
            index = len(self._stripes)
            mapped: list[int] = []
            try:
                for segment, page in enumerate(stripe):
                    va = self.segment_va(segment) + index * self.page_bytes
                    supply.map_page(va, page)
                    mapped.append(va)
            except BaseException:  # undo this stripe; earlier stripes stay (uncommitted, reclaimable)
                for va in mapped:
                    supply.driver.unmap_page(va)
                supply.park(pages[start:], self._charge)
                raise
            self._stripes.append(stripe)
        return None

    def map_ahead_target(self) -> int:
        """Stripes a growing tenant should have mapped: its prefix plus ``map_ahead_stripes``, within its max."""
        return min(self._committed + self.map_ahead_stripes, self.max_stripes)

    def reclaim(self) -> None:
        """Unmap the stripes above the committed prefix (plus map-ahead while growing) that no fence protects."""
        self._prune()
        if any(p.lowest < len(self._stripes) for p in self._pending):
            return  # stripes go top down, so one protected stripe blocks all
        floor = self._committed + (self.map_ahead_stripes if self._growing else 0)
        if floor < len(self._stripes):
            self._unmap_above(floor)

    def give_up_top(self, *, wait: bool) -> bool:
        """Unmap the top stripe (above the prefix) into the pool's idle list; ``True`` when done.

        Without ``wait`` only if no undone fence protects it; with it, wait for those fences
        (their work was submitted, so the wait ends).
        """
        top = len(self._stripes) - 1
        if top < self._committed:
            return False
        blocking = [p for p in self._pending if p.lowest <= top and not p.fence.done()]
        if blocking and not wait:
            return False
        for pending in blocking:
            pending.fence.wait()
        self._prune()
        self._unmap_above(top)
        return True

    def retire(self) -> None:
        """After a release to 0: wait for every fence, unmap everything, free the range and the charge."""
        for pending in self._pending:
            pending.fence.wait()
        self._pending.clear()
        self._unmap_above(0)
        self._supply.driver.free_reservation(self.va, self.total_bytes)
        self._charge.close()
        self.closed = True

    def check(self) -> list[Page]:
        """Verify the module's invariants; returns the mapped pages. :class:`ElasticError` names a broken one."""
        if not 0 <= self._committed <= len(self._stripes) <= self.max_stripes:
            raise ElasticError(f"{self.name}: committed {self._committed} / mapped "
                               f"{len(self._stripes)} / max {self.max_stripes} stripes out of order")
        for stripe in self._stripes:
            if len(stripe) != self.segments:
                raise ElasticError(f"{self.name}: a stripe has {len(stripe)} pages, not {self.segments}")
        held = self._charge.ledger_bytes
        if held is not None and held != self.mapped_bytes:
            raise ElasticError(f"{self.name}: ledger holds {held} B but {self.mapped_bytes} B are mapped")
        return [page for stripe in self._stripes for page in stripe]

    def _prune(self) -> None:
        self._pending = [p for p in self._pending if not p.fence.done()]

    def _unmap_above(self, floor: int) -> None:
        """Unmap stripes ``floor..`` (top down) and park their pages idle."""
        removed = self._stripes[floor:]
        if not removed:
            return
        now = time.monotonic()
        for index in range(len(self._stripes) - 1, floor - 1, -1):
            for segment, page in enumerate(self._stripes[index]):
                self._supply.unmap_page(self.segment_va(segment) + index * self.page_bytes)
                page.parked_at = now
        del self._stripes[floor:]
        self._supply.park([page for stripe in removed for page in stripe], self._charge)
