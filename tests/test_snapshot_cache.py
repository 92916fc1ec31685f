"""The prefix-keyed snapshot cache: lookups against a brute-force reference, restores against full recompute,
another model's snapshots never found."""

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
OTHER = ModelFingerprint("d", "another fake", 1, 1, 1, 1)


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


def fake(n_tokens: int, nbytes: int = 1, fingerprint: ModelFingerprint = FINGERPRINT) -> Snapshot:
    return Snapshot(SnapshotIdentity(fingerprint, StateLayout(256, 1, "auto", False), n_tokens, None),
                    CountedStore(nbytes))


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=8)


@given(st.lists(st.tuples(tokens_st, st.booleans()), max_size=8), tokens_st)
def test_find_returns_the_longest_cached_key_of_its_model_that_prefixes_the_query(keys, query):
    with SnapshotCache() as cache:
        for key, other in keys:
            cache.put(key, fake(len(key), fingerprint=OTHER if other else FINGERPRINT))
        for model, other in ((FINGERPRINT, False), (OTHER, True)):
            prefixes = [tuple(k) for k, o in keys if o == other and tuple(query[:len(k)]) == tuple(k)]
            found = cache.find(query, model)
            if not prefixes:
                assert found is None
            else:
                assert found is not None and found.fingerprint == model and found.n_tokens == max(map(len, prefixes))


def test_least_recently_used_entries_are_evicted_and_released():
    cache = SnapshotCache(capacity_bytes=20)
    a, b, c = fake(1, 10), fake(2, 10), fake(3, 10)
    cache.put([1], a)
    cache.put([1, 2], b)
    assert cache.find([1, 9], FINGERPRINT) is a  # a is now the most recently used
    cache.put([1, 2, 3], c)
    assert b.released and not a.released and len(cache) == 2 and cache.nbytes == 20
    assert cache.find([1, 2, 7], FINGERPRINT) is a
    replacement = fake(1, 5)
    cache.put([1], replacement)  # the old snapshot under that key is released
    assert a.released and cache.find([1], FINGERPRINT) is replacement
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
        model = tiny_model.fingerprint
        assert cache.find(doc[:15], model).n_tokens == 10 and cache.find(doc[:5], model) is None
        with Context(tiny_model, n_ctx=256) as target:
            assert cache.restore(query, target, longer_than=len(doc)) == 0 and target.seq_len(0) == 0
            assert cache.restore(query, target) == len(doc)
            np.testing.assert_array_equal(target.logits(prefill(target, query[len(doc):])), reference)
    assert pool.stats.bytes_in_use == 0  # closing the cache released every snapshot


def test_a_snapshot_that_is_not_its_key_is_refused(tiny_model, doc):
    with SnapshotCache() as cache, Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, doc[:12], logits_last=False)
        with Snapshot.capture(ctx, tokens=doc[:12]) as snap:
            with pytest.raises(SnapshotMismatch, match="12 tokens cannot be cached as 11"):
                cache.put(doc[:11], snap)
            with pytest.raises(SnapshotMismatch, match="other token ids"):
                cache.put(doc[1:13], snap)
            assert not snap.released and len(cache) == 0  # a refused snapshot stays the caller's


def test_another_models_snapshot_of_the_same_tokens_is_never_found_nor_restored(tiny_model, other_tiny_model_path,
                                                                               doc):
    with SnapshotCache() as cache, Model(other_tiny_model_path) as other:
        with Context(other, n_ctx=256) as octx:
            prefill(octx, doc, logits_last=False)
            cache.put(doc, Snapshot.capture(octx, tokens=doc))
        with Context(tiny_model, n_ctx=256) as ctx:
            assert cache.find(doc, tiny_model.fingerprint) is None
            assert cache.restore(doc, ctx) == 0 and ctx.seq_len(0) == 0
            prefill(ctx, doc[:12], logits_last=False)
            cache.put(doc[:12], Snapshot.capture(ctx, tokens=doc[:12]))  # both models' snapshots side by side
        assert len(cache) == 2
        assert cache.find(doc, tiny_model.fingerprint).n_tokens == 12
        assert cache.find(doc, other.fingerprint).n_tokens == len(doc)


def test_restore_passes_over_a_snapshot_the_context_cannot_take(tiny_model, doc):
    """A longer cached prefix that does not fit the target (too many tokens, other KV layout) gives way to a shorter."""
    tokens = (doc * 8)[:300]
    with SnapshotCache() as cache:
        for cut, flash in ((12, "off"), (300, "off"), (30, "on")):
            with Context(tiny_model, n_ctx=512, flash_attn=flash) as ctx:
                prefill(ctx, tokens[:cut], logits_last=False)
                cache.put(tokens[:cut], Snapshot.capture(ctx, tokens=tokens[:cut]))
        with Context(tiny_model, n_ctx=256, flash_attn="off") as small:
            assert small.n_ctx_seq < 300
            assert cache.restore(tokens, small) == 12 and small.seq_len(0) == 12
        with Context(tiny_model, n_ctx=512, flash_attn="on") as wide:
            assert cache.restore(tokens, wide) == 30 and wide.seq_len(0) == 30  # the only one of its layout
