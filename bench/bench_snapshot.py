"""Microbenchmarks of the fan-out primitives: snapshot capture, restore, fork by seq_cp, disk round trip.

Run: ``pytest bench/bench_snapshot.py --benchmark-enable`` (plain ``pytest`` runs each
once as a test). The model is a generated tiny F32 llama unless ``KVRT_BENCH_MODEL``
names a GGUF (e.g. the demo model, or the 7B-shaped preset on the GPU machine);
``KVRT_BENCH_DOC_TOKENS`` sets the document length (default 512).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.state.contextpool import ContextPool
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot
from kvrt_bench.fanout import fox_document

DOC_TOKENS = int(os.environ.get("KVRT_BENCH_DOC_TOKENS", "512"))
N_FORKS = 8


@pytest.fixture(scope="module")
def params() -> ContextParams:
    return ContextParams(n_ctx=-(-(DOC_TOKENS + 64) // 256) * 256)


@pytest.fixture(scope="module")
def source(model: Model, params: ContextParams):
    """A context whose sequence 0 holds the document."""
    doc = fox_document(model, DOC_TOKENS)
    with Context(model, params) as ctx:
        prefill(ctx, doc, logits_last=False)
        yield ctx, doc


@pytest.fixture(scope="module")
def host_pool() -> HostPool:
    return HostPool()


def test_capture_host(benchmark, source, host_pool):
    ctx, doc = source

    def capture() -> None:
        Snapshot.capture(ctx, pool=host_pool).release()

    benchmark(capture)
    assert host_pool.stats.reuses > 0 or benchmark.disabled  # pooled buffers, not a fresh allocation per capture


def test_restore_host_into_pooled_context(benchmark, source, model, params, host_pool):
    ctx, doc = source
    snapshot = Snapshot.capture(ctx, pool=host_pool, tokens=doc)
    with ContextPool(model, params) as pool:
        target = pool.acquire()
        benchmark(snapshot.restore, target)
        assert target.seq_len(0) == len(doc)
        pool.release(target)
    snapshot.release()


def test_restore_device_tier(benchmark, model, params):
    doc = fox_document(model, DOC_TOKENS)
    with Context(model, ContextParams(n_ctx=params.n_ctx * 2, n_seq_max=2, kv_unified=True)) as ctx:
        prefill(ctx, doc, logits_last=False)
        snapshot = Snapshot.capture(ctx, tier="device")
        benchmark(snapshot.restore, ctx, 1)
        assert ctx.seq_len(1) == len(doc)
        snapshot.release()


def test_fork_by_seq_cp(benchmark, model):
    """Sharing the prefix with N_FORKS sequences: metadata only, independent of document length."""
    doc = fox_document(model, DOC_TOKENS)
    with Context(model, n_ctx=-(-(DOC_TOKENS + 64) // 256) * 256, n_seq_max=N_FORKS + 1, kv_unified=True) as ctx:
        prefill(ctx, doc, logits_last=False)

        def fork() -> None:
            for seq in range(1, N_FORKS + 1):
                ctx.seq_rm(seq)
                ctx.seq_cp(0, seq)

        benchmark(fork)
        assert all(ctx.seq_len(seq) == len(doc) for seq in range(N_FORKS + 1))


def test_disk_round_trip(benchmark, source, host_pool, tmp_path: Path):
    ctx, doc = source
    snapshot = Snapshot.capture(ctx, pool=host_pool, tokens=doc)
    path = tmp_path / "doc.kvs"

    def round_trip() -> None:
        snapshot.save(path)
        Snapshot.load(path, host_pool).release()

    benchmark(round_trip)
    snapshot.release()
