"""The prefix cache's second tier: slots evicted from the context kept as host copies of their sequence state.

An agent whose cached history had to leave the context (its slot or cells were needed by
others) comes back by one ``llama_state_seq_set_data`` of the copy instead of a prefill
of its whole transcript. An entry is exactly llama.cpp's state of its token prefix, so a
restore puts the same KV back that was evicted.

The tier's memory is one :class:`HostArena` of ``capacity_bytes``, taken once when the
tier is made: an entry is a piece of it, and entries least recently used leave until a
new one finds room, those of no agent first (an entry keeps the agent that owned its slot).
Why one arena: entries come and go in every size, and pinning memory
for each (``cudaHostAlloc``, the memory a GPU reads at the PCIe limit) costs more than
the copy into it; it ran inside admission, on the engine's step. Where the arena lives is
the caller's choice: plain NumPy memory by default (pages committed as they are first
written), pinned on a GPU machine (:func:`kvrt.state.hostpool.host_memory`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvrt.checks import check_int
from kvrt.errors import KvrtError
from kvrt.prefixes import Eviction, PrefixTree, TokenIds

HostMemory = Callable[[int], np.ndarray]  # nbytes -> that many writable uint8 bytes, kept alive by the array

ALIGN = 64  # pieces start on cache lines


def numpy_memory(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def piece_size(nbytes: int) -> int:
    """The arena bytes a piece of ``nbytes`` takes (whole cache lines, at least one)."""
    return max(-(-nbytes // ALIGN) * ALIGN, ALIGN)


class HostArena:
    """``memory`` handed out in pieces: first fit, and a piece given back merges with its free neighbours.

    Invariant: the free extents are sorted by offset, disjoint and never adjacent, and they and the
    pieces handed out cover the memory exactly (:meth:`free_bytes` + pieces' sizes = capacity).
    """

    def __init__(self, memory: np.ndarray) -> None:
        if memory.dtype != np.uint8 or memory.ndim != 1:
            raise KvrtError(f"a host arena needs a 1-D uint8 array, got {memory.dtype} of shape {memory.shape}")
        self.memory = memory
        self._starts: list[int] = [0] if len(memory) else []  # free extents: their offsets ...
        self._sizes: list[int] = [len(memory)] if len(memory) else []  # ... and sizes, in offset order

    @property
    def capacity(self) -> int:
        return len(self.memory)

    def free_bytes(self) -> int:
        return sum(self._sizes)

    def alloc(self, nbytes: int) -> ArenaPiece | None:
        """A piece of at least ``nbytes`` (its view exactly ``nbytes``), or ``None`` while no free run is long
        enough."""
        size = piece_size(nbytes)
        for i, free in enumerate(self._sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                return ArenaPiece(self, start, size, nbytes)
        return None

    def _give_back(self, start: int, size: int) -> None:
        i = bisect.bisect(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # merge with the extent before
            i -= 1
            self._sizes[i] += size
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:  # and after
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._starts[i + 1]


class ArenaPiece:
    """A piece of a :class:`HostArena`: ``view`` is its first ``nbytes``; :meth:`release` gives it back (once)."""

    __slots__ = ("_arena", "start", "size", "nbytes")

    def __init__(self, arena: HostArena, start: int, size: int, nbytes: int) -> None:
        self._arena: HostArena | None = arena
        self.start, self.size, self.nbytes = start, size, nbytes

    @property
    def view(self) -> np.ndarray:
        if self._arena is None:
            raise KvrtError("this piece of host memory was given back to its arena")
        return self._arena.memory[self.start:self.start + self.nbytes]

    def release(self) -> None:
        if self._arena is not None:
            self._arena._give_back(self.start, self.size)
            self._arena = None


def owner_priority(owner: str | None) -> int:
    """An eviction priority (:class:`kvrt.prefixes.Eviction`): an agent's history outlives anonymous prefixes."""
    return 0 if owner is None else 1


@dataclass(frozen=True)
class HostEntry:
    """A host copy of one slot's sequence state, holding exactly ``tokens``: the first ``nbytes`` of ``piece``;
    its first ``cold`` positions were computed as a cold prefill computes them (:mod:`kvrt.runtime.prefix_cache`);
    ``owner``: the agent whose history it is (``None``: anonymous); ``released_at``: when that slot's last sequence
    finished (``time.monotonic``; ``None``: not known), so that a next turn restoring it says how long it took to
    come back (:mod:`kvrt.runtime.turn_hold`)."""

    tokens: tuple[int, ...]
    piece: ArenaPiece
    nbytes: int
    cold: int = 0
    owner: str | None = None
    released_at: float | None = None

    @property
    def state(self) -> np.ndarray:
        """llama.cpp's sequence state bytes (uint8)."""
        return self.piece.view[:self.nbytes]


@dataclass(frozen=True)
class HostTierStats:
    """What the tier did since it was made: copies kept (bytes, seconds writing them) and entries dropped."""

    kept: int
    kept_bytes: int
    keep_s: float
    dropped: int


class HostTier:
    """Host copies of evicted slots, keyed by their tokens in a :class:`PrefixTree` (a copy that is a prefix of a
    newer one is dropped), least recently used out first (:class:`Eviction`)."""

    def __init__(self, capacity_bytes: int, *, min_tokens: int = 32, memory: HostMemory = numpy_memory) -> None:
        self.capacity_bytes = check_int(capacity_bytes, "host tier capacity_bytes", low=0)
        self.min_tokens = check_int(min_tokens, "host tier min_tokens", low=1)
        self._arena = HostArena(memory(self.capacity_bytes) if self.capacity_bytes else numpy_memory(0))
        self._entries: PrefixTree[HostEntry] = PrefixTree()
        self._eviction: Eviction[tuple[int, ...]] = Eviction()
        self.nbytes = 0
        self._kept = self._kept_bytes = self._dropped = 0
        self._keep_s = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stats(self) -> HostTierStats:
        return HostTierStats(self._kept, self._kept_bytes, self._keep_s, self._dropped)

    def worth_keeping(self, n_tokens: int) -> bool:
        return n_tokens >= self.min_tokens and self.capacity_bytes > 0

    def holds(self, tokens: TokenIds, *, cold: int = 0, owner: str | None = None) -> bool:
        """Whether an entry already is what :meth:`keep` of these arguments would make: exactly ``tokens``,
        at least ``cold`` of them computed cold, the same ``owner``."""
        entry = self._entries.get(tokens)
        return entry is not None and entry.cold >= cold and entry.owner == owner

    def keep(self, tokens: Sequence[int], nbytes: int, write: Callable[[np.ndarray], int], *, cold: int = 0,
             owner: str | None = None, released_at: float | None = None, make_room: bool = True) -> bool:
        """Keep the state of exactly ``tokens`` (the first ``cold`` computed cold; ``owner``'s history, or
        anonymous; its slot released at ``released_at``): ``write(view)`` fills ``nbytes`` of host memory and
        returns the bytes it wrote. An entry that :meth:`holds` it already is marked recently used, nothing
        copied. Least recently used entries leave until the copy finds room, anonymous ones before agents'
        (``make_room=False``: none leaves, the copy is made only into free room); False when it is not made
        (larger than the tier, or no free room). ``write``'s exception propagates, leaving the tier without the
        copy."""
        key = tuple(int(t) for t in tokens)
        if self.holds(key, cold=cold, owner=owner):
            self._eviction.touch(key)
            return True
        if piece_size(nbytes) > self.capacity_bytes:
            return False
        t0 = time.perf_counter()
        piece = self._arena.alloc(nbytes)
        if piece is None and not make_room:
            return False
        for _, old in self._entries.prefixes(key):
            self._drop(old.tokens)  # the new copy holds all of it
        if piece is None:  # the dropped prefixes' room first, then least recently used entries
            piece = self._arena.alloc(nbytes)
        while piece is None and (victim := self._eviction.victim()) is not None:
            self._drop(victim)
            piece = self._arena.alloc(nbytes)
        if piece is None:  # only entries hold pieces, so an empty tier's arena is one free run: a bug if reached
            raise KvrtError(f"host tier: no room for {nbytes} bytes with every entry dropped "
                            f"({self._arena.free_bytes()} of {self.capacity_bytes} free)")
        try:
            written = write(piece.view)
        except BaseException:
            piece.release()
            raise
        self._entries.insert(key, HostEntry(key, piece, written, cold, owner, released_at))
        self._eviction.add(key, priority=owner_priority(owner))
        self.nbytes += written
        self._kept += 1
        self._kept_bytes += written
        self._keep_s += time.perf_counter() - t0
        return True

    def keep_bytes(self, tokens: Sequence[int], state: np.ndarray, *, owner: str | None = None) -> bool:
        """:meth:`keep` of a state already in host memory (``state``: its bytes, copied; nothing computed cold)."""
        data = np.asarray(state, dtype=np.uint8).reshape(-1)

        def write(view: np.ndarray) -> int:
            view[:data.size] = data
            return int(data.size)
        return bool(tokens) and self.keep(tokens, int(data.size), write, owner=owner)

    def longest(self, tokens: TokenIds, *, cold_unit: int = 0) -> tuple[HostEntry | None, int]:
        """The entry sharing the longest prefix with ``tokens``, and the length shared (marked recently used).
        With ``cold_unit``, only the part an entry holds computed cold counts, in whole units of that many."""
        if not cold_unit:
            best, best_len = self._entries.longest(tokens)
        else:
            best, best_len = None, 0
            for entry, shared in self._entries.sharing(tokens):  # most shared first: none later beats best_len
                if shared <= best_len:
                    break
                length = min(shared, entry.cold) // cold_unit * cold_unit
                if length > best_len:
                    best, best_len = entry, length
        if best is not None:
            self._eviction.touch(best.tokens)
        return best, best_len

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.remove(key)
        self._eviction.discard(key)
        self.nbytes -= entry.nbytes
        self._dropped += 1
        entry.piece.release()

    def pop_owned(self, owner: str) -> tuple[tuple[int, ...], np.ndarray] | None:
        """Take ``owner``'s history out: the tokens and a copy of the state of its longest entry (``None`` when it
        has none), every entry it owns dropped."""
        owned = [entry for _, entry in self._entries.items() if entry.owner == owner]
        if not owned:
            return None
        longest = max(owned, key=lambda entry: len(entry.tokens))
        taken = longest.tokens, longest.state.copy()
        for entry in owned:
            self._drop(entry.tokens)
        return taken

    def clear(self) -> None:
        """Drop every entry, giving its memory back to the arena."""
        for key, _ in list(self._entries.items()):
            self._drop(key)

    def close(self) -> None:
        """Drop every entry and let the arena's memory go (pinned memory is unpinned when nothing else holds it);
        the tier keeps nothing from here on."""
        self.clear()
        self._arena = HostArena(numpy_memory(0))
        self.capacity_bytes = 0
