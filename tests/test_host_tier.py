"""The prefix cache's host tier on its own: capacity, least-recently-used order, superseded prefixes."""

from __future__ import annotations

import pytest

from kvrt.engine.host_tier import HostBlock, HostTier, numpy_block
from kvrt.errors import KvrtError
from kvrt.state.hostpool import HostPool


def state(nbytes: int) -> tuple[HostBlock, int]:
    return numpy_block(nbytes), nbytes


def test_longest_prefix_capacity_and_recency():
    tier = HostTier(100, min_tokens=2)
    assert tier.put([1, 2, 3], *state(40)) and tier.put([7, 8], *state(40))
    entry, n = tier.longest([1, 2, 9])
    assert entry is not None and entry.tokens == (1, 2, 3) and n == 2  # and [1, 2, 3] is now the most recent
    assert tier.put([5, 6], *state(40))  # 120 bytes > 100: the least recently used ([7, 8]) goes
    assert tier.longest([7, 8])[0] is None and tier.longest([1, 2, 3])[1] == 3 and tier.nbytes == 80
    assert not tier.put([4, 4], *state(101))  # alone over the capacity: refused, nothing dropped
    assert len(tier) == 2 and tier.longest([9]) == (None, 0)


def test_a_longer_copy_supersedes_its_prefixes():
    tier = HostTier(1000)
    tier.put([1, 2], *state(10))
    tier.put([1, 2, 3, 4], *state(20))
    assert len(tier) == 1 and tier.nbytes == 20 and tier.longest([1, 2])[0].tokens == (1, 2, 3, 4)


def test_worth_keeping_and_bad_settings():
    assert not HostTier(0).worth_keeping(1000) and not HostTier(10, min_tokens=32).worth_keeping(31)
    with pytest.raises(KvrtError, match="capacity_bytes"):
        HostTier(-1)


def test_blocks_from_an_allocator_go_back_when_dropped_refused_or_cleared():
    pool = HostPool(pinned=False)
    tier = HostTier(3 * 4096, min_tokens=1, alloc=pool.acquire)
    blocks = [tier.alloc(4096) for _ in range(4)]
    assert pool.stats.bytes_in_use == 4 * 4096
    for i, block in enumerate(blocks[:3]):
        assert tier.put([100 + i], block, 4096)
    assert tier.put([200], blocks[3], 4096)  # over capacity: the least recently used entry's block goes back
    assert blocks[0].released and not any(b.released for b in blocks[1:]) and len(tier) == 3
    assert tier.longest([101])[0].state.nbytes == 4096
    oversized = tier.alloc(4 * 4096)
    assert not tier.put([300], oversized, 4 * 4096) and oversized.released  # refused: released at once
    tier.clear()
    assert len(tier) == 0 and tier.nbytes == 0 and pool.stats.bytes_in_use == 0
