"""Microbenchmarks of the VRAM ledger: reserve/release pairs, resize, snapshot, and 8-thread contention.

Run: ``pytest bench/bench_ledger.py --benchmark-enable`` (``--benchmark-disable`` runs each
once as a plain test, invariants still checked). Target (issue 4): >= 500k
``try_reserve``/``release`` pairs per second on one core; the contention benchmark
reports pairs per second across 8 threads and checks the books balance afterwards.
"""

from __future__ import annotations

import threading

import pytest

from kvrt.accounting.ledger import LedgerDenied, VramLedger

PAIRS = 10_000
THREADS = 8


@pytest.fixture()
def ledger() -> VramLedger:
    return VramLedger(1 << 40)


def test_reserve_release_pairs(benchmark, ledger):
    reserve, release = ledger.try_reserve, ledger.release

    def pairs() -> None:
        for _ in range(PAIRS):
            release(reserve(4096, "agent:a"))

    benchmark.extra_info["pairs_per_round"] = PAIRS
    benchmark(pairs)
    assert ledger.allocated_bytes == 0
    if benchmark.stats:
        benchmark.extra_info["pairs_per_s"] = PAIRS / benchmark.stats.stats.mean


def test_denied_reserve(benchmark):
    full = VramLedger(100)
    full.try_reserve(100, "model:a")

    def deny() -> None:
        for _ in range(PAIRS):
            try:
                full.try_reserve(1, "agent:b")
            except LedgerDenied:
                pass

    benchmark(deny)
    assert full.allocated_bytes == 100


def test_resize(benchmark, ledger):
    held = ledger.try_reserve(1000, "model:a")

    def resize() -> None:
        for i in range(PAIRS):
            ledger.resize(held, 1000 + (i & 1))

    benchmark(resize)
    assert ledger.allocated_bytes == held.nbytes


def test_snapshot_with_many_owners(benchmark, ledger):
    held = [ledger.try_reserve(10, f"agent:{i}") for i in range(1000)]
    snap = benchmark(ledger.snapshot)
    assert snap.allocated_bytes == 10 * len(held)


def test_contention_eight_threads(benchmark):
    """8 threads reserve and release against one lock; the cap is hit, the books must balance."""
    ledger = VramLedger(THREADS * 50 * 4096)

    def contend() -> None:
        barrier = threading.Barrier(THREADS)

        def worker() -> None:
            barrier.wait()
            held = []
            for i in range(PAIRS // THREADS):
                try:
                    held.append(ledger.try_reserve(4096, "agent:t"))
                except LedgerDenied:
                    pass
                if i % 2 and held:
                    ledger.release(held.pop())
            for r in held:
                ledger.release(r)

        threads = [threading.Thread(target=worker) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert ledger.allocated_bytes == 0 and not ledger.snapshot().reservations

    benchmark(contend)
    if benchmark.stats:
        benchmark.extra_info["ops_per_s"] = PAIRS / benchmark.stats.stats.mean
