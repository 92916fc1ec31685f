"""Snapshots keyed by the tokens they hold: find the longest cached prefix of a token sequence.

The way llama-cpp-python's prompt cache (``llama_cache.py``, ``_find_longest_prefix_key``)
finds a state to resume from, for kvrt snapshots: a fan-out, a pipeline watermark or a
FORK that has the state of ``tokens[:k]`` cached restores it and decodes only the rest.

Invariants: a key is the model's fingerprint and exactly the token ids its snapshot
holds (checked against the snapshot's length and, when it has one, its token hash), so
one cache may hold several models' snapshots and a lookup, which names its model, never
finds another model's (a :class:`kvrt.prefixes.PrefixTree` per model: a lookup is one walk
down it, not a scan of every entry); the cache owns its snapshots and releases each one it evicts,
replaces or drops on :meth:`SnapshotCache.close`, least recently used first when the
bytes held pass ``capacity_bytes``. :meth:`SnapshotCache.restore` restores under the
cache's lock, so a snapshot it picks cannot be evicted and released by another thread
before it is copied.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvrt.engine.context import Context
from kvrt.engine.model import ModelFingerprint
from kvrt.prefixes import Eviction, PrefixTree
from kvrt.state.snapshot import Snapshot, SnapshotError, SnapshotMismatch, token_hash

_Key = tuple[ModelFingerprint, tuple[int, ...]]


class SnapshotCache:
    """A least-recently-used map from token prefixes to the snapshots holding them (thread-safe).

    ``capacity_bytes``: the most snapshot bytes kept, all models together (``None``: no
    limit). A snapshot that :meth:`find` returned stays owned by the cache: use it before a
    later :meth:`put` can evict it (a released snapshot refuses to restore), or let
    :meth:`restore` pick and restore it in one step.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise SnapshotError(f"capacity_bytes must be non-negative, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._trees: dict[ModelFingerprint, PrefixTree[Snapshot]] = {}
        self._eviction: Eviction[_Key] = Eviction()  # least recently used first
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._eviction)

    def put(self, tokens: Sequence[int], snapshot: Snapshot) -> None:
        """Cache ``snapshot`` (now owned by the cache) as its model's state of ``tokens``; evicts to fit the capacity.

        A snapshot that is not the state of ``tokens`` is refused and left to the caller.
        One larger than the whole capacity is released at once.
        """
        ids = tuple(int(t) for t in tokens)
        if snapshot.n_tokens != len(ids):
            raise SnapshotMismatch(f"a snapshot of {snapshot.n_tokens} tokens cannot be cached as {len(ids)} tokens")
        if snapshot.tokens_hash is not None and snapshot.tokens_hash != token_hash(ids):
            raise SnapshotMismatch("the snapshot holds other token ids than its key")
        key = (snapshot.fingerprint, ids)
        with self._lock:
            replaced = self._pop(key) if key in self._eviction else None
            self._trees.setdefault(snapshot.fingerprint, PrefixTree()).insert(ids, snapshot)
            self._eviction.add(key)
            self._nbytes += snapshot.nbytes
            evicted = self._evict()
        for old in ([replaced] if replaced is not None and replaced is not snapshot else []) + evicted:
            old.release()

    def find(self, tokens: Sequence[int], fingerprint: ModelFingerprint) -> Snapshot | None:
        """The snapshot of model ``fingerprint`` whose tokens are the longest cached prefix of ``tokens`` (or None)."""
        with self._lock:
            found = self._prefixes(tokens, fingerprint, 0)
            if not found:
                return None
            self._eviction.touch((fingerprint, found[0][1]))
            return found[0][0]

    def restore(self, tokens: Sequence[int], ctx: Context, seq_id: int = 0, *, longer_than: int = 0) -> int:
        """Restore into ``seq_id`` of ``ctx`` the longest cached prefix of ``tokens`` that it can take; its length.

        Only snapshots of ``ctx``'s model holding more than ``longer_than`` tokens are
        considered, longest first; one whose layout or length the context cannot take
        (:meth:`Snapshot.check_compatible`) is passed over. Returns 0, the sequence
        untouched, when none fits.
        """
        with self._lock:
            for snapshot, ids in self._prefixes(tokens, ctx.model.fingerprint, longer_than):
                try:
                    snapshot.check_compatible(ctx, seq_id)
                except SnapshotMismatch:
                    continue
                snapshot.restore(ctx, seq_id)
                self._eviction.touch((snapshot.fingerprint, ids))
                return snapshot.n_tokens
        return 0

    def close(self) -> None:
        """Release every cached snapshot."""
        with self._lock:
            snapshots = [snapshot for tree in self._trees.values() for _, snapshot in tree.items()]
            self._trees.clear()
            self._eviction = Eviction()
            self._nbytes = 0
        for snapshot in snapshots:
            snapshot.release()

    def __enter__(self) -> SnapshotCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pop(self, key: _Key) -> Snapshot:
        """Take one entry out (locked)."""
        fingerprint, ids = key
        snapshot = self._trees[fingerprint].remove(ids)
        if not self._trees[fingerprint]:
            del self._trees[fingerprint]
        self._eviction.discard(key)
        self._nbytes -= snapshot.nbytes
        return snapshot

    def _evict(self) -> list[Snapshot]:
        """Drop least recently used entries until the bytes held fit ``capacity_bytes``; returns them (locked)."""
        evicted = []
        while self.capacity_bytes is not None and self._nbytes > self.capacity_bytes:
            victim = self._eviction.victim()
            if victim is None:
                break
            evicted.append(self._pop(victim))
        return evicted

    def _prefixes(self, tokens: Sequence[int], fingerprint: ModelFingerprint,
                  longer_than: int) -> list[tuple[Snapshot, tuple[int, ...]]]:
        """Model ``fingerprint``'s snapshots of more than ``longer_than`` tokens that prefix ``tokens``, with
        their keys' tokens, longest first (locked)."""
        tree = self._trees.get(fingerprint)
        if tree is None:
            return []
        query = tuple(int(t) for t in tokens)
        return [(snapshot, query[:n]) for n, snapshot in tree.prefixes(query) if n > longer_than]
