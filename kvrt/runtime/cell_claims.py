"""The cells each slot of a context holds, and how many slots claim each cell: the part of
:class:`kvrt.runtime.prefix_cache.PrefixCache`'s mirror that counts occupied cells.

A decoded position takes one cell. In the shared layout slots share a prefix by sharing its cells
(``seq_cp``), and a cell is free again once no slot claims it, as in llama.cpp's cache; in the split
layout a copy gives the destination cells of its own, so every claim is a cell's only one. The ids here
are the mirror's own, not llama.cpp's cell indices: ``n_cells`` of them, a free one taken for each position
written and given back with its last claim. So each change is a NumPy pass over the cells it touches, never
a Python loop over them: one admission may evict 64 slots of 8k cells each, and ask what evicting would free.

Invariants: ``claims[c]`` is the number of slots whose row holds ``c``; a slot's row holds each id at most
once (a cell holds one position); the free stack's first ``_n_free`` entries are exactly the ids no slot
claims, so :attr:`used` is ``n_cells - _n_free``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvrt.errors import KvrtError
from kvrt.runtime.slot_tokens import SlotTokens


class CellClaims:
    """Each slot's cell ids in position order (one growable int64 row a slot) and each cell's claim count."""

    __slots__ = ("_rows", "_claims", "_free", "_n_free")

    def __init__(self, n_slots: int, n_cells: int) -> None:
        self._rows = SlotTokens(n_slots)  # the same growable row-per-slot table, here of cell ids
        self._claims = np.zeros(n_cells, dtype=np.int32)
        self._free = np.arange(n_cells - 1, -1, -1, dtype=np.int64)  # a stack: its first _n_free ids are free
        self._n_free = n_cells

    @property
    def used(self) -> int:
        """Cells claimed by at least one slot."""
        return len(self._claims) - self._n_free

    def held(self, slot: int) -> int:
        return self._rows.length(slot)

    def append(self, slot: int, n: int) -> None:
        """``n`` positions written after the slot's last one: a new cell each."""
        if n > self._n_free:
            raise KvrtError(f"the cache mirror has {self._n_free} free cells of {len(self._claims)}, "
                            f"and a decode wrote {n} new positions into slot {slot}: the mirror is out of step")
        ids = self._free[self._n_free - n:self._n_free]
        self._n_free -= n
        self._claims[ids] = 1
        self._rows.extend(slot, ids)  # copied into the row before the stack's slots are reused

    def share(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst`` (holding ``p0`` positions) claims ``src``'s cells of positions ``[p0, p1)`` too."""
        ids = self._rows.view(src, p1)[p0:]
        self._claims[ids] += 1  # distinct within a row: no id is counted twice in one pass
        self._rows.extend(dst, ids)

    def truncate(self, slot: int, keep: int) -> None:
        """The slot lets go of its positions from ``keep`` on; a cell no slot claims any more is free."""
        ids = self._rows.view(slot)[keep:]
        if not ids.size:
            return
        self._claims[ids] -= 1
        freed = ids[self._claims[ids] == 0]
        self._free[self._n_free:self._n_free + len(freed)] = freed
        self._n_free += len(freed)
        self._rows.truncate(slot, keep)

    def distinct(self, slots: Iterable[int], prefix: tuple[int, int] | None = None) -> int:
        """How many cells ``slots`` hold between them, with the first ``prefix[1]`` of slot ``prefix[0]``'s."""
        held = np.zeros(len(self._claims), dtype=bool)
        for slot in slots:
            held[self._rows.view(slot)] = True
        if prefix is not None:
            held[self._rows.view(*prefix)] = True
        return int(np.count_nonzero(held))
