"""What leaves a tier first: the least recently used entry of the lowest priority, never a pinned one.

A tier (device slots, the host tier, the snapshot cache) keeps its entries under keys of
its own and tells :class:`Eviction` when each is added, used, pinned or gone; it asks
:meth:`Eviction.victim` for the next one to drop. Priority is for entries worth more than
their recency says (an agent's own history over an anonymous prefix): every entry of a
lower priority leaves before any of a higher one. Invariant: every key added and not
discarded is in exactly one place, its priority's recency order or the pinned set.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Set
from typing import Generic, TypeVar

from kvrt.errors import KvrtError

K = TypeVar("K", bound=Hashable)


class Eviction(Generic[K]):
    """Keys in eviction order: by priority (lowest first), then least recently used first; pinned keys apart."""

    def __init__(self) -> None:
        self._orders: dict[int, OrderedDict[K, None]] = {}  # priority -> its keys, least recently used first
        self._priority: dict[K, int] = {}
        self._pinned: set[K] = set()

    def __len__(self) -> int:
        return len(self._priority)

    def __contains__(self, key: object) -> bool:
        return key in self._priority

    def __iter__(self) -> Iterator[K]:
        """The unpinned keys, next victim first."""
        for priority in sorted(self._orders):
            yield from self._orders[priority]

    def add(self, key: K, *, priority: int = 0) -> None:
        """A new entry, the most recently used of its priority (re-adding a key moves it)."""
        pinned = key in self._pinned
        self.discard(key)
        self._priority[key] = priority
        if pinned:
            self._pinned.add(key)
        else:
            self._orders.setdefault(priority, OrderedDict())[key] = None

    def touch(self, key: K) -> None:
        """The entry was used: the most recently used of its priority."""
        order = self._orders.get(self._priority[key]) if key in self._priority else None
        if order is not None and key in order:
            order.move_to_end(key)

    def discard(self, key: K) -> None:
        """The entry is gone (nothing happens for a key not held)."""
        priority = self._priority.pop(key, None)
        self._pinned.discard(key)
        if priority is not None and key in self._orders.get(priority, ()):
            del self._orders[priority][key]
            if not self._orders[priority]:
                del self._orders[priority]

    def pin(self, key: K) -> None:
        """Never choose the entry until :meth:`unpin`."""
        if key not in self._priority:
            raise KvrtError(f"cannot pin {key!r}: not held")
        order = self._orders[self._priority[key]] if key not in self._pinned else None
        if order is not None:
            del order[key]
            if not order:
                del self._orders[self._priority[key]]
        self._pinned.add(key)

    def unpin(self, key: K) -> None:
        """The entry may be chosen again, as the most recently used of its priority."""
        if key in self._pinned:
            self._pinned.discard(key)
            self._orders.setdefault(self._priority[key], OrderedDict())[key] = None

    def pinned(self, key: K) -> bool:
        return key in self._pinned

    @property
    def pins(self) -> Set[K]:
        """The pinned keys (a live view: read it, do not keep it)."""
        return self._pinned

    def victim(self, *, avoid: K | None = None) -> K | None:
        """The next entry to drop (not ``avoid``), or ``None`` when every entry is pinned or there is none."""
        return next((key for key in self if key != avoid), None)
