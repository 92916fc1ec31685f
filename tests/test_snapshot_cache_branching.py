"""Fan-outs and pipelines sharing a SnapshotCache: what comes from the cache, and the tokens against recompute.

The reference is a fresh context that prefills the document in the segments the cached
run cut it into (the cached prefix, then the rest), then generates each branch greedily:
a restored prefix is the cached state bit for bit, so that is the computation a
cache hit continues.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvrt.branching.branches import Branch, FanoutError, FanoutResult, fanout
from kvrt.branching.pipeline import Pipeline, PipelineError
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.engine.model import Model
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot
from kvrt.state.snapshot_cache import SnapshotCache

TEXT = "The quick brown fox jumps over the lazy dog. " * 8
ENDING = " Then a small grey cat walked in and sat on the mat."
BRANCHES = [
    Branch(" Summary:", GenerationParams(max_tokens=10), "summary"),
    Branch(" The animal", GenerationParams(max_tokens=7), "animal"),
    Branch(" Q?", GenerationParams(max_tokens=12), "q"),
]


def recompute(model: Model, segments: Sequence[Sequence[int]], branch: Branch, n_batch: int = 512) -> list[int]:
    """Greedy tokens of ``branch`` after the segments, each prefilled in ``n_batch`` chunks, in a fresh context."""
    with Context(model, n_ctx=1024, n_batch=n_batch, n_ubatch=min(n_batch, 512), flash_attn="off") as ctx:
        for segment in segments:
            prefill(ctx, segment, logits_last=False)
        return generate(ctx, model.tokenize(branch.prompt, add_special=False), branch.params).tokens


def tokens_of(result: FanoutResult) -> list[list[int]]:
    return [b.completion.tokens for b in result.branches]


@pytest.fixture(scope="module")
def doc(tiny_model: Model) -> list[int]:
    return tiny_model.tokenize(TEXT)


@pytest.fixture(scope="module")
def longer(tiny_model: Model, doc: list[int]) -> list[int]:
    """The document and a continuation: it shares ``doc`` as a prefix."""
    return doc + tiny_model.tokenize(ENDING, add_special=False)


@pytest.fixture(scope="module")
def references(tiny_model: Model, doc: list[int]) -> list[list[int]]:
    return [recompute(tiny_model, [doc], b) for b in BRANCHES]


@pytest.mark.parametrize("mode, exact", [("isolated", False), ("isolated", True), ("shared", False),
                                         ("shared", True)])
def test_a_second_fanout_restores_the_whole_document_and_gives_the_uncached_tokens(tiny_model, doc, references,
                                                                                  mode, exact):
    plain = fanout(tiny_model, doc, BRANCHES, mode=mode, exact=exact)
    pool = HostPool(pinned=False)
    with SnapshotCache() as cache:
        first = fanout(tiny_model, doc, BRANCHES, mode=mode, exact=exact, cache=cache, host_pool=pool)
        assert first.reused_tokens == 0 and len(cache) == 1
        second = fanout(tiny_model, doc, BRANCHES, mode=mode, exact=exact, cache=cache, host_pool=pool)
        assert second.reused_tokens == len(doc) and len(cache) == 1  # nothing new to cache
        assert (second.mode, second.exact) == (mode, exact)
        assert tokens_of(first) == tokens_of(second) == tokens_of(plain)
    if exact or mode == "isolated":  # what the fan-out's docstring promises of these on a model without SWA
        assert tokens_of(second) == references
    assert plain.reused_tokens == 0 and pool.stats.bytes_in_use == 0  # closing the cache released its snapshots


@pytest.mark.parametrize("mode", ["isolated", "shared"])
def test_a_longer_document_prefills_only_what_the_cache_lacks(tiny_model, doc, longer, mode):
    progress: list[tuple[int, int]] = []
    with SnapshotCache() as cache:
        fanout(tiny_model, doc, BRANCHES[:1], mode="isolated", exact=True, cache=cache)
        result = fanout(tiny_model, longer, BRANCHES, mode=mode, exact=True, cache=cache,
                        progress=lambda *event: progress.append(event))
        assert result.reused_tokens == len(doc) and result.doc_tokens == len(longer)
        assert tokens_of(result) == [recompute(tiny_model, [doc, longer[len(doc):]], b) for b in BRANCHES]
        assert progress[0] == (len(doc), len(longer)) and progress[-1] == (len(longer), len(longer))
        assert len(cache) == 2 and cache.find(longer + [1], tiny_model.fingerprint).n_tokens == len(longer)


def test_another_models_cached_document_is_never_used(tiny_model, other_tiny_model_path, doc, references):
    with SnapshotCache() as cache, Model(other_tiny_model_path) as other:
        theirs = fanout(other, doc, BRANCHES, mode="isolated", cache=cache)
        assert theirs.reused_tokens == 0 and len(cache) == 1
        ours = fanout(tiny_model, doc, BRANCHES, mode="isolated", cache=cache)
        assert ours.reused_tokens == 0 and tokens_of(ours) == references
        assert len(cache) == 2  # one snapshot of each model, each found only for its own
        assert fanout(other, doc, BRANCHES, mode="isolated", cache=cache).reused_tokens == len(doc)


def test_a_pipeline_watermark_is_found_by_a_later_fanout_of_a_longer_document(tiny_model, doc):
    mark = 37  # not a multiple of n_batch=16: the prefill's segments end at the watermark
    short = GenerationParams(max_tokens=6)
    forked = doc[:mark] + tiny_model.tokenize(ENDING, add_special=False)  # shares only the watermark's prefix
    assert forked[:mark + 1] != doc[:mark + 1]
    with SnapshotCache() as cache:
        pipe = Pipeline(tiny_model, n_ctx=1024, n_batch=16, cache=cache)
        pipe.document("doc", doc)
        pipe.branch("early", " Q:", after="doc", params=short, need_tokens=mark)
        pipe.branch("late", " Q:", after="doc", params=short)
        first = pipe.run()
        assert first.reused_tokens == {"doc": 0} and len(cache) == 2  # the watermark's snapshot and the document's
        again = pipe.run()
        assert again.reused_tokens == {"doc": len(doc)}
        assert {k: again.outputs[k].tokens for k in ("early", "late")} == {k: first.outputs[k].tokens
                                                                          for k in ("early", "late")}
        result = fanout(tiny_model, forked, BRANCHES, mode="isolated", exact=True, n_batch=16, cache=cache)
        assert result.reused_tokens == mark
        assert tokens_of(result) == [recompute(tiny_model, [doc[:mark], forked[mark:]], b, n_batch=16)
                                     for b in BRANCHES]


def test_a_pipeline_resumes_a_document_from_a_fanouts_snapshot(tiny_model, doc, longer):
    short = GenerationParams(max_tokens=6)
    with SnapshotCache() as cache:
        fanout(tiny_model, doc, BRANCHES[:1], mode="isolated", exact=True, n_batch=16, cache=cache)
        pipe = Pipeline(tiny_model, n_ctx=1024, n_batch=16, cache=cache)
        pipe.document("longer", longer)
        pipe.branch("early", " Q:", after="longer", params=short, need_tokens=20)  # before the cached prefix ends
        pipe.branch("late", " Q:", after="longer", params=short)
        result = pipe.run()
        # the watermark at 20 is prefilled (nothing cached ends there); the segment after it resumes from the
        # fan-out's whole document, so the 20 tokens prefilled before it are the only ones computed twice
        assert result.reused_tokens == {"longer": len(doc) - 20}
        late = Branch(" Q:", short)
        assert result.outputs["early"].tokens == recompute(tiny_model, [longer[:20]], late, n_batch=16)
        assert result.outputs["late"].tokens == recompute(tiny_model, [doc, longer[len(doc):]], late, n_batch=16)


def test_capacity_eviction_does_not_break_a_run(tiny_model, doc, longer):
    with Context(tiny_model, n_ctx=1024, flash_attn="off") as ctx:  # how many bytes the two documents' states take
        prefill(ctx, longer, logits_last=False)
        with Snapshot.capture(ctx) as snap:
            longer_bytes = snap.nbytes
        ctx.seq_rm(0, len(doc), -1)
        with Snapshot.capture(ctx) as snap:
            doc_bytes = snap.nbytes
    pool = HostPool(pinned=False)
    with SnapshotCache(capacity_bytes=longer_bytes + doc_bytes // 2) as cache:  # room for one of them
        fanout(tiny_model, doc, BRANCHES, mode="isolated", cache=cache, host_pool=pool)
        result = fanout(tiny_model, longer, BRANCHES, mode="isolated", exact=True, cache=cache, host_pool=pool)
        # the put of the longer document evicted the prefix it had just restored
        assert result.reused_tokens == len(doc) and len(cache) == 1
        expected = [recompute(tiny_model, [doc, longer[len(doc):]], b) for b in BRANCHES]
        assert tokens_of(result) == expected
        again = fanout(tiny_model, longer, BRANCHES, mode="shared", exact=True, cache=cache, host_pool=pool)
        assert again.reused_tokens == len(longer) and tokens_of(again) == expected
        assert fanout(tiny_model, doc, BRANCHES, mode="isolated", cache=cache).reused_tokens == 0  # evicted
    with SnapshotCache(capacity_bytes=1) as tiny_cache:  # keeps nothing: every put is released at once
        runs = [fanout(tiny_model, doc, BRANCHES, mode="isolated", cache=tiny_cache, host_pool=pool) for _ in "ab"]
        assert [r.reused_tokens for r in runs] == [0, 0] and len(tiny_cache) == 0
        assert tokens_of(runs[0]) == tokens_of(runs[1])
        pipe = Pipeline(tiny_model, n_ctx=1024, cache=tiny_cache, host_pool=pool)
        pipe.document("doc", doc)
        pipe.branch("q", " Q?", after="doc", params=GenerationParams(max_tokens=4))
        assert pipe.run().ok and len(tiny_cache) == 0
    assert pool.stats.bytes_in_use == 0


def test_a_cache_of_the_wrong_kind_is_refused(tiny_model):
    with pytest.raises(FanoutError, match="cache must be a SnapshotCache or None, got"):
        fanout(tiny_model, "a document", ["a question"], cache={})
    with pytest.raises(PipelineError, match="cache must be a SnapshotCache or None, got"):
        Pipeline(tiny_model, cache=[])


def test_demo_model_cached_document_within_the_window_keeps_exact_tokens(demo_model):
    """Gemma 3 has sliding-window layers: within the window a restored document is its prefill's cells at its slots,
    so exact=True from the cache is the exact fan-out's tokens (which the exactness tests hold to llama-cpp-python)."""
    doc = demo_model.tokenize("The quick brown fox jumps over the lazy dog. " * 20)
    assert len(doc) + 40 < 512  # document + branch inside the 512-token window
    branches = [Branch(" Summary:", GenerationParams(max_tokens=12)),
                Branch(" The animal", GenerationParams(max_tokens=12))]
    plain = fanout(demo_model, doc, branches, mode="isolated", exact=True, n_threads=2)
    with SnapshotCache() as cache:
        fanout(demo_model, doc, branches[:1], mode="shared", exact=True, n_threads=2, cache=cache)
        for mode in ("isolated", "shared"):
            hit = fanout(demo_model, doc, branches, mode=mode, exact=True, n_threads=2, cache=cache)
            assert hit.reused_tokens == len(doc) and tokens_of(hit) == tokens_of(plain), mode
