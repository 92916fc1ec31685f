"""The prefix-keyed snapshot cache: lookups against a brute-force reference, restores against full recompute."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrt.engine.context import Context
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model, ModelFingerprint
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot, SnapshotIdentity, SnapshotMismatch, StateLayout
from kvrt.state.snapshot_cache import SnapshotCache
from kvrt.state.stores import SnapshotStore

TEXT = "The quick brown fox jumps over the lazy dog. " * 6
FINGERPRINT = ModelFingerprint("c", "fake", 1, 1, 1, 1)


class CountedStore(SnapshotStore):
    """A store of ``nbytes`` that only counts its releases (for lookups, which never restore)."""

    tier = "host"

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes
        self.releases = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def restore(self, ctx, seq_id, identity):  # pragma: no cover - lookups never restore
        raise AssertionError

    def host_bytes(self, identity):  # pragma: no cover
        raise AssertionError

    def release(self) -> None:
        self.releases += 1


def fake(n_tokens: int, nbytes: int = 1) -> Snapshot:
    return Snapshot(SnapshotIdentity(FINGERPRINT, StateLayout(256, 1, "auto", False), n_tokens, None),
                    CountedStore(nbytes))


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=8)


@given(st.lists(tokens_st, max_size=8), tokens_st)
def test_find_returns_the_longest_cached_key_that_prefixes_the_query(keys, query):
    with SnapshotCache() as cache:
        for key in keys:
            cache.put(key, fake(len(key)))
        prefixes = [k for k in map(tuple, keys) if tuple(query[:len(k)]) == k]
        found = cache.find(query)
        if not prefixes:
            assert found is None
        else:
            assert found is not None and found.n_tokens == max(map(len, prefixes))


def test_least_recently_used_entries_are_evicted_and_released():
    cache = SnapshotCache(capacity_bytes=20)
    a, b, c = fake(1, 10), fake(2, 10), fake(3, 10)
    cache.put([1], a)
    cache.put([1, 2], b)
    assert cache.find([1, 9]) is a  # a is now the most recently used
    cache.put([1, 2, 3], c)
    assert b.released and not a.released and len(cache) == 2 and cache.nbytes == 20
    assert cache.find([1, 2, 7]) is a
    replacement = fake(1, 5)
    cache.put([1], replacement)  # the old snapshot under that key is released
    assert a.released and cache.find([1]) is replacement
    cache.close()
    assert c.released and replacement.released and len(cache) == 0
    too_big = fake(2, 50)
    SnapshotCache(capacity_bytes=20).put([4, 4], too_big)
    assert too_big.released


@pytest.fixture(scope="module")
def doc(tiny_model: Model) -> list[int]:
    return tiny_model.tokenize(TEXT)


def test_restoring_the_longest_prefix_and_decoding_the_rest_equals_full_recompute(tiny_model, doc):
    query = doc + tiny_model.tokenize(" In one word, the animal is", add_special=False)
    with Context(tiny_model, n_ctx=256) as ctx:  # the same chunks, computed from scratch
        prefill(ctx, doc, logits_last=False)
        reference = ctx.logits(prefill(ctx, query[len(doc):]))
    pool = HostPool(pinned=False)
    with SnapshotCache() as cache, Context(tiny_model, n_ctx=256) as ctx:
        for cut in (10, 20, len(doc)):
            ctx.seq_rm(0)
            prefill(ctx, doc[:cut], logits_last=False)
            cache.put(doc[:cut], Snapshot.capture(ctx, pool=pool, tokens=doc[:cut]))
        assert cache.find(doc[:15]).n_tokens == 10 and cache.find(doc[:5]) is None
        hit = cache.find(query)
        assert hit is not None and hit.n_tokens == len(doc)
        with Context(tiny_model, n_ctx=256) as target:
            hit.restore(target)
            np.testing.assert_array_equal(target.logits(prefill(target, query[hit.n_tokens:])), reference)
    assert pool.stats.bytes_in_use == 0  # closing the cache released every snapshot


def test_a_snapshot_that_is_not_its_key_or_of_another_model_is_refused(tiny_model, other_tiny_model_path, doc):
    with SnapshotCache() as cache, Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, doc[:12], logits_last=False)
        with Snapshot.capture(ctx, tokens=doc[:12]) as snap:
            with pytest.raises(SnapshotMismatch, match="12 tokens cannot be cached as 11"):
                cache.put(doc[:11], snap)
            with pytest.raises(SnapshotMismatch, match="other token ids"):
                cache.put(doc[1:13], snap)
            with Model(other_tiny_model_path) as other, Context(other, n_ctx=256) as octx:
                prefill(octx, doc[:12], logits_last=False)
                cache.put(doc[:12], Snapshot.capture(octx, tokens=doc[:12]))
                with pytest.raises(SnapshotMismatch, match="the cache holds snapshots of"):
                    cache.put(doc[:12], snap)
            assert not snap.released and len(cache) == 1  # a refused snapshot stays the caller's
