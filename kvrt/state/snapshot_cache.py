"""Snapshots keyed by the tokens they hold: find the longest cached prefix of a token sequence.

The way llama-cpp-python's prompt cache (``llama_cache.py``, ``_find_longest_prefix_key``)
finds a state to resume from, for kvrt snapshots: a fan-out, a pipeline watermark or a
FORK that has the state of ``tokens[:k]`` cached restores it and decodes only the rest.

Invariants: a key is exactly the token ids its snapshot holds (checked against the
snapshot's length and, when it has one, its token hash); every snapshot is of the
cache's one model; the cache owns its snapshots and releases each one it evicts,
replaces or drops on :meth:`SnapshotCache.close`, least recently used first when the
bytes held pass ``capacity_bytes``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvrt.state.snapshot import Snapshot, SnapshotError, SnapshotMismatch, token_hash


class SnapshotCache:
    """A least-recently-used map from token prefixes to the snapshots holding them (thread-safe).

    ``capacity_bytes``: the most snapshot bytes kept (``None``: no limit). A snapshot that
    :meth:`find` returned stays owned by the cache: use it before a later :meth:`put` can
    evict it (a released snapshot refuses to restore).
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise SnapshotError(f"capacity_bytes must be non-negative, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(snapshot.nbytes for snapshot in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, tokens: Sequence[int], snapshot: Snapshot) -> None:
        """Cache ``snapshot`` (now owned by the cache) as the state of ``tokens``; evicts to stay within capacity.

        A snapshot that is not the state of ``tokens`` or not of the cache's model is refused
        and left to the caller. One larger than the whole capacity is released at once.
        """
        key = tuple(int(t) for t in tokens)
        if snapshot.n_tokens != len(key):
            raise SnapshotMismatch(f"a snapshot of {snapshot.n_tokens} tokens cannot be cached as {len(key)} tokens")
        if snapshot.tokens_hash is not None and snapshot.tokens_hash != token_hash(key):
            raise SnapshotMismatch("the snapshot holds other token ids than its key")
        with self._lock:
            model = next(iter(self._entries.values()), snapshot).fingerprint
            if model != snapshot.fingerprint:
                raise SnapshotMismatch(f"the cache holds snapshots of {model.description!r}, not of "
                                       f"{snapshot.fingerprint.description!r}")
            replaced = self._entries.pop(key, None)
            self._entries[key] = snapshot
            evicted = self._evict()
        for old in ([replaced] if replaced is not None and replaced is not snapshot else []) + evicted:
            old.release()

    def find(self, tokens: Sequence[int]) -> Snapshot | None:
        """The snapshot of the longest cached key that is a prefix of ``tokens`` (``None``: none is)."""
        query = tuple(int(t) for t in tokens)
        with self._lock:
            best: tuple[int, ...] | None = None
            for key in self._entries:
                if len(key) <= len(query) and (best is None or len(key) > len(best)) and query[:len(key)] == key:
                    best = key
            if best is None:
                return None
            self._entries.move_to_end(best)
            return self._entries[best]

    def close(self) -> None:
        """Release every cached snapshot."""
        with self._lock:
            snapshots = list(self._entries.values())
            self._entries.clear()
        for snapshot in snapshots:
            snapshot.release()

    def __enter__(self) -> SnapshotCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _evict(self) -> list[Snapshot]:
        """Drop least recently used entries until the bytes held fit ``capacity_bytes``; returns them (locked)."""
        if self.capacity_bytes is None:
            return []
        held = sum(snapshot.nbytes for snapshot in self._entries.values())
        evicted = []
        while held > self.capacity_bytes and self._entries:
            _, snapshot = self._entries.popitem(last=False)
            held -= snapshot.nbytes
            evicted.append(snapshot)
        return evicted
