"""The tokens each slot of a context holds, position by position, as one table.

Admission asks, for every request it places, which slot shares the longest prefix with the
prompt (:meth:`kvrt.runtime.prefix_cache.PrefixCache.longest_prefix`). With a row array a slot,
that is one NumPy comparison a slot, and each one releases the GIL and takes it back: while
HTTP threads parse the next turn's bodies, every such hand-off may cost the engine's thread a
whole switch interval (``kvrt serve --gil-switch-s``). One table of a row a slot answers it in a
single comparison of every slot at once (:meth:`SlotTokens.common_prefixes`).

Invariant: row ``s`` holds slot ``s``'s tokens in its first ``length(s)`` entries; what lies
after them is stale and never read as a token. The table is as wide as the longest slot has
been (doubling as it grows): at most ``n_slots`` x the context's cells x 8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrt.prefixes import common_prefix


class SlotTokens:
    """Each slot's tokens in a row of one growable int64 table (the dtype of ``Request.prompt_array`` and
    :func:`common_prefix`, so no comparison converts)."""

    __slots__ = ("_table", "_lengths")

    def __init__(self, n_slots: int, width: int = 256) -> None:
        self._table = np.empty((n_slots, max(1, width)), dtype=np.int64)  # ``width``: tokens a row before it grows
        self._lengths = np.zeros(n_slots, dtype=np.int64)

    def length(self, slot: int) -> int:
        return int(self._lengths[slot])

    def view(self, slot: int, stop: int | None = None) -> np.ndarray:
        """The slot's first ``stop`` tokens (all by default), without a copy: valid until its row is written."""
        n = self.length(slot)
        return self._table[slot, :n if stop is None else min(stop, n)]

    def extend(self, slot: int, tokens: Sequence[int] | np.ndarray) -> None:
        new = np.asarray(tokens, dtype=np.int64)
        start = self.length(slot)
        end = start + len(new)
        if end > self._table.shape[1]:
            grown = np.empty((self._table.shape[0], max(end, 2 * self._table.shape[1])), dtype=np.int64)
            width = int(self._lengths.max())
            grown[:, :width] = self._table[:, :width]
            self._table = grown  # ``new`` may be a view of the old table: it keeps that buffer alive
        self._table[slot, start:end] = new
        self._lengths[slot] = end

    def truncate(self, slot: int, keep: int) -> None:
        self._lengths[slot] = min(self.length(slot), keep)

    def begins_with(self, slot: int, prefix: np.ndarray) -> bool:
        """Whether the slot's first ``len(prefix)`` tokens are ``prefix`` (int64); the last of them is compared
        first, so a slot that differs there costs no pass over the rest."""
        k = len(prefix)
        if self.length(slot) < k or (k and self._table[slot, k - 1] != prefix[k - 1]):
            return False
        return common_prefix(self.view(slot, k), prefix) == k

    def common_prefixes(self, probe: np.ndarray) -> np.ndarray:
        """How many leading tokens each slot shares with ``probe`` (int64), by slot, in one comparison."""
        n = min(len(probe), int(self._lengths.max()))
        if n == 0:
            return np.zeros_like(self._lengths)
        differs = self._table[:, :n] != probe[:n]
        first = differs.argmax(axis=1)  # each row's first difference (0 where none)
        shared = np.where(differs[np.arange(len(first)), first], first, n)
        return np.minimum(shared, self._lengths)  # what lies past a slot's tokens is stale
