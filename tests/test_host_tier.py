"""The prefix cache's host tier on its own: capacity, least-recently-used order, superseded prefixes."""

from __future__ import annotations

import numpy as np
import pytest

from kvrt.engine.host_tier import HostTier
from kvrt.errors import KvrtError


def state(nbytes: int) -> np.ndarray:
    return np.zeros(nbytes, dtype=np.uint8)


def test_longest_prefix_capacity_and_recency():
    tier = HostTier(100, min_tokens=2)
    assert tier.put([1, 2, 3], state(40)) and tier.put([7, 8], state(40))
    entry, n = tier.longest([1, 2, 9])
    assert entry is not None and entry.tokens == (1, 2, 3) and n == 2  # and [1, 2, 3] is now the most recent
    assert tier.put([5, 6], state(40))  # 120 bytes > 100: the least recently used ([7, 8]) goes
    assert tier.longest([7, 8])[0] is None and tier.longest([1, 2, 3])[1] == 3 and tier.nbytes == 80
    assert not tier.put([4, 4], state(101))  # alone over the capacity: refused, nothing dropped
    assert len(tier) == 2 and tier.longest([9]) == (None, 0)


def test_a_longer_copy_supersedes_its_prefixes():
    tier = HostTier(1000)
    tier.put([1, 2], state(10))
    tier.put([1, 2, 3, 4], state(20))
    assert len(tier) == 1 and tier.nbytes == 20 and tier.longest([1, 2])[0].tokens == (1, 2, 3, 4)


def test_worth_keeping_and_bad_settings():
    assert not HostTier(0).worth_keeping(1000) and not HostTier(10, min_tokens=32).worth_keeping(31)
    with pytest.raises(KvrtError, match="capacity_bytes"):
        HostTier(-1)
