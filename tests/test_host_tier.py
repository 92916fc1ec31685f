"""The prefix cache's host tier on its own: its arena, capacity, least-recently-used order, superseded prefixes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.errors import KvrtError
from kvrt.runtime.host_tier import ALIGN, HostArena, HostTier, numpy_memory, piece_size


def filler(value: int, nbytes: int):
    """A ``write`` that fills ``nbytes`` with ``value`` and says so."""
    def write(view: np.ndarray) -> int:
        view[:nbytes] = value
        return nbytes
    return write


def test_longest_prefix_capacity_and_recency():
    tier = HostTier(3 * ALIGN, min_tokens=2)
    assert tier.keep([1, 2, 3], ALIGN, filler(1, ALIGN)) and tier.keep([7, 8], ALIGN, filler(7, ALIGN))
    entry, n = tier.longest([1, 2, 9])
    assert entry is not None and entry.tokens == (1, 2, 3) and n == 2  # and [1, 2, 3] is now the most recent
    assert tier.keep([5, 6], 2 * ALIGN, filler(5, 2 * ALIGN))  # no room: the least recently used ([7, 8]) goes
    assert tier.longest([7, 8])[0] is None and tier.longest([1, 2, 3])[1] == 3 and tier.nbytes == 3 * ALIGN
    assert (tier.longest([1, 2, 3])[0].state == 1).all() and (tier.longest([5, 6])[0].state == 5).all()
    assert not tier.keep([4, 4], 3 * ALIGN + 1, filler(4, 1))  # alone over the capacity: refused, nothing dropped
    assert len(tier) == 2 and tier.longest([9]) == (None, 0)
    assert tier.stats.kept == 3 and tier.stats.kept_bytes == 4 * ALIGN and tier.stats.dropped == 1


def test_a_longer_copy_supersedes_its_prefixes():
    tier = HostTier(1000)
    tier.keep([1, 2], 10, filler(0, 10))
    tier.keep([1, 2, 3, 4], 20, filler(0, 20))
    assert len(tier) == 1 and tier.nbytes == 20 and tier.longest([1, 2])[0].tokens == (1, 2, 3, 4)


def test_the_entry_holds_what_the_writer_wrote_and_a_failed_write_keeps_nothing():
    tier = HostTier(4 * ALIGN, min_tokens=1)
    assert tier.keep([1], 3 * ALIGN, lambda view: 100)  # a state smaller than its size: only what was written
    assert tier.longest([1])[0].state.nbytes == 100 and tier.nbytes == 100

    def broken(view: np.ndarray) -> int:
        raise KvrtError("the context refused")

    with pytest.raises(KvrtError, match="refused"):
        tier.keep([2], 3 * ALIGN, broken)  # room was made ([1] dropped), then the copy failed
    assert len(tier) == 0 and tier.nbytes == 0
    assert tier.keep([3], 4 * ALIGN, filler(3, 4 * ALIGN))  # and the whole arena is free again


def test_a_copy_the_tier_holds_is_not_made_again_and_marked_recently_used():
    tier = HostTier(2 * ALIGN, min_tokens=1)
    assert tier.keep([1, 2], ALIGN, filler(1, ALIGN), owner="a") and tier.keep([3], ALIGN, filler(3, ALIGN))

    def must_not_write(view: np.ndarray) -> int:
        raise AssertionError("the tier copied a state it already holds")

    assert tier.holds([1, 2], owner="a") and not tier.holds([1, 2]) and not tier.holds([1])
    assert tier.keep([1, 2], ALIGN, must_not_write, owner="a")  # held: [1, 2] is now the most recently used
    assert tier.keep([4], ALIGN, filler(4, ALIGN))  # so [3] leaves for [4]
    assert tier.longest([3])[0] is None and (tier.longest([1, 2])[0].state == 1).all()
    assert tier.stats.kept == 3 and not tier.holds([1, 2], cold=1, owner="a")  # a colder copy is not that one


def test_a_copy_without_making_room_takes_free_room_only():
    tier = HostTier(2 * ALIGN, min_tokens=1)
    assert tier.keep([1], ALIGN, filler(1, ALIGN), make_room=False)
    assert not tier.keep([2], 2 * ALIGN, filler(2, 2 * ALIGN), make_room=False)  # no room: nothing leaves
    assert len(tier) == 1 and (tier.longest([1])[0].state == 1).all() and tier.stats.dropped == 0
    assert tier.keep([1, 5], ALIGN, filler(5, ALIGN), make_room=False)  # free room; it supersedes [1]
    assert len(tier) == 1 and tier.longest([1])[0].tokens == (1, 5) and tier.nbytes == ALIGN


def test_worth_keeping_close_and_bad_settings():
    assert not HostTier(0).worth_keeping(1000) and not HostTier(10, min_tokens=32).worth_keeping(31)
    tier = HostTier(ALIGN, min_tokens=1)
    tier.keep([1], ALIGN, filler(1, ALIGN))
    tier.close()
    assert len(tier) == 0 and not tier.worth_keeping(1000) and not tier.keep([2], 1, filler(2, 1))
    with pytest.raises(KvrtError, match="capacity_bytes"):
        HostTier(-1)
    with pytest.raises(KvrtError, match="1-D uint8"):
        HostArena(np.empty(8, dtype=np.int64))


def test_the_tier_takes_its_memory_once():
    calls: list[int] = []

    def memory(nbytes: int) -> np.ndarray:
        calls.append(nbytes)
        return numpy_memory(nbytes)

    tier = HostTier(8 * ALIGN, min_tokens=1, memory=memory)
    for i in range(20):
        tier.keep([i, i], (1 + i % 3) * ALIGN, filler(i, ALIGN))
    assert calls == [8 * ALIGN]


def test_a_piece_given_back_twice_is_given_back_once():
    arena = HostArena(numpy_memory(2 * ALIGN))
    piece = arena.alloc(ALIGN)
    piece.release()
    piece.release()
    assert arena.free_bytes() == 2 * ALIGN and arena.alloc(2 * ALIGN) is not None
    with pytest.raises(KvrtError, match="given back"):
        _ = piece.view


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=60))
def test_arena_pieces_never_overlap_and_freed_space_merges(ops):
    """Against a byte map: pieces handed out are disjoint and inside the arena, the free count is exact, and with
    every piece given back the arena is one free run again (first fit finds the whole capacity)."""
    capacity = 16 * ALIGN
    arena = HostArena(numpy_memory(capacity))
    owner = np.full(capacity, -1)
    pieces = []
    for n, (give_back, nbytes) in enumerate(ops):
        if give_back and pieces:
            piece = pieces.pop(nbytes % len(pieces))
            owner[piece.start:piece.start + piece.size] = -1
            piece.release()
        else:
            piece = arena.alloc(nbytes)
            if piece is None:
                assert not any(size >= piece_size(nbytes) for size in _free_runs(owner))  # first fit missed nothing
                continue
            assert piece.size == piece_size(nbytes) and piece.view.nbytes == nbytes
            assert (owner[piece.start:piece.start + piece.size] == -1).all()
            owner[piece.start:piece.start + piece.size] = n
            pieces.append(piece)
        assert arena.free_bytes() == int((owner == -1).sum())
    for piece in pieces:
        piece.release()
    assert arena.free_bytes() == capacity and arena.alloc(capacity) is not None


def _free_runs(owner: np.ndarray) -> list[int]:
    """Lengths of the maximal runs of free bytes (-1) in the byte map."""
    runs, run = [], 0
    for value in [*owner, 0]:
        if value == -1:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    return runs
