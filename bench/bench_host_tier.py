"""Microbenchmark of the batching engine's host tier: an evicted history restored from its host copy vs prefilled.

Run: ``pytest bench/bench_host_tier.py --benchmark-enable`` (plain ``pytest`` runs each once
as a test). The model is a generated tiny F32 llama unless ``KVRT_BENCH_MODEL`` names a
GGUF (e.g. the demo model); ``KVRT_BENCH_DOC_TOKENS`` sets the history's length (default
512), ``KVRT_BENCH_FLASH_ATTN`` the context's flash attention (default ``off``). Every
benchmark puts the same history into an empty slot of one unified-KV context, through
:meth:`kvrt.runtime.prefix_cache.PrefixCache.restore` (what a returning agent costs with
the tier) from the tier's own copy (in its arena from :func:`kvrt.state.hostpool.host_memory`,
as the servers make it: pinned on a GPU machine) and from a NumPy copy (pageable), or
by a prefill (what it costs without); each checks the slot holds the history and continues
with the token the original did. The physical ideal, in the same run: the state's bytes
copied once from the tier's buffer to where a restore puts them (a pinned host-to-device
copy through CuPy where a GPU is usable, else a memcpy between two warm host buffers); a
restore that beat it would be a bug in the benchmark.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.runtime.host_tier import HostArena, HostEntry, HostTier, numpy_memory, piece_size
from kvrt.runtime.prefix_cache import PrefixCache
from kvrt.state.hostpool import host_memory
from kvrt.system.gpu import cupy_usable
from kvrt_bench.fanout import fox_document

DOC_TOKENS = int(os.environ.get("KVRT_BENCH_DOC_TOKENS", "512"))
FLASH_ATTN = os.environ.get("KVRT_BENCH_FLASH_ATTN", "off")


@pytest.fixture(scope="module")
def cache(model: Model):
    """A two-slot cache whose host tier holds the history evicted from slot 0, and the history's next token."""
    doc = fox_document(model, DOC_TOKENS)
    params = ContextParams(n_ctx=-(-(2 * DOC_TOKENS + 64) // 256) * 256, n_seq_max=2, kv_unified=True,
                           flash_attn=FLASH_ATTN)
    with Context(model, params) as ctx:
        prefill(ctx, doc, seq_id=0, logits_last=False)  # once, to size the tier: twice the history's state
        state_bytes = ctx.seq_state_size(0)
        ctx.seq_rm(0)
        cache = PrefixCache(ctx, HostTier(2 * state_bytes, memory=host_memory))
        slot = cache.claim()
        assert slot is not None
        prefill(ctx, doc, seq_id=slot, logits_last=False)
        cache.appended(slot, doc)
        expected = _next_token(cache, slot, doc)
        cache.release(slot)
        cache.evict(slot)  # copied to the host tier first
        entry, held = cache.host_prefix(doc)
        assert entry is not None and held == len(doc)
        yield cache, doc, expected


def _empty_slot(cache: PrefixCache) -> int:
    slot = cache.claim()
    assert slot is not None
    return slot


def _next_token(cache: PrefixCache, slot: int, doc: list[int]) -> int:
    """The token after the history in ``slot``: its last token decoded again at its own position (the slot
    holds the history again afterwards)."""
    cache.truncate(slot, len(doc) - 1)
    token = int(np.argmax(cache.ctx.logits(prefill(cache.ctx, doc[-1:], seq_id=slot))))
    cache.appended(slot, doc[-1:])
    return token


def _bench(benchmark, cache: PrefixCache, doc: list[int], expected: int, fill) -> None:
    slots: list[int] = []

    def setup() -> None:
        for slot in slots:
            cache.evict(slot, keep_copy=False)
        slots[:] = [_empty_slot(cache)]

    benchmark.extra_info["history_tokens"] = len(doc)
    benchmark.pedantic(lambda: fill(slots[0]), setup=setup, rounds=5, iterations=1)
    slot = slots[0]
    assert cache.ctx.seq_len(slot) == len(doc) and _next_token(cache, slot, doc) == expected
    cache.evict(slot, keep_copy=False)


def test_returning_history_restored_from_the_host_tier(benchmark, cache):
    tier, doc, expected = cache
    entry, _ = tier.host_prefix(doc)
    benchmark.extra_info["state_bytes"] = int(entry.state.nbytes)
    benchmark.extra_info["pinned"] = cupy_usable()  # host_memory pins where CuPy sees a GPU
    _bench(benchmark, tier, doc, expected, lambda slot: tier.restore(slot, entry, len(doc)) or pytest.fail("refused"))


def test_returning_history_restored_from_a_numpy_copy(benchmark, cache):
    tier, doc, expected = cache
    entry, _ = tier.host_prefix(doc)
    piece = HostArena(numpy_memory(piece_size(entry.nbytes))).alloc(entry.nbytes)
    assert piece is not None
    pageable = HostEntry(entry.tokens, piece, entry.nbytes)
    np.copyto(pageable.state, entry.state)
    benchmark.extra_info["state_bytes"] = int(entry.nbytes)
    _bench(benchmark, tier, doc, expected,
           lambda slot: tier.restore(slot, pageable, len(doc)) or pytest.fail("refused"))


def test_returning_history_prefilled_again(benchmark, cache):
    tier, doc, expected = cache

    def fill(slot: int) -> None:
        prefill(tier.ctx, doc, seq_id=slot, logits_last=False)
        tier.appended(slot, doc)

    _bench(benchmark, tier, doc, expected, fill)


def test_ideal_copy_of_the_state(benchmark, cache):
    tier, doc, _ = cache
    entry, _ = tier.host_prefix(doc)
    benchmark.extra_info["state_bytes"] = int(entry.state.nbytes)
    if cupy_usable():
        import cupy

        target = cupy.empty(entry.nbytes, dtype=cupy.uint8)

        def copy() -> None:
            target.set(entry.state)
            cupy.cuda.Device().synchronize()

        benchmark.extra_info["ideal"] = "pinned host-to-device copy (CuPy)"
        benchmark.pedantic(copy, rounds=5, iterations=1, warmup_rounds=1)
        assert np.array_equal(target.get(), entry.state)
    else:
        host = np.empty_like(entry.state)
        benchmark.extra_info["ideal"] = "host memcpy"
        benchmark.pedantic(lambda: np.copyto(host, entry.state), rounds=5, iterations=1, warmup_rounds=1)
        assert np.array_equal(host, entry.state)
