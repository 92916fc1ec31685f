"""Microbenchmark of the cache mirror's cell claims in the admission that changes workloads at N = 64.

Run: ``pytest bench/bench_cell_claims.py --benchmark-enable`` (plain ``pytest`` runs each once as a test).
The shape of issue 24's H200 preset after its fanout: 64 slots sharing one 8,192-token document and 96
tokens each of their own, in the shared layout. The swarm's agents then evict all 64 (``PrefixCache.evict``:
every slot's claims dropped), after fanout's admission gave 63 agents the document (``copy_prefix``: a share
of 8,192 cells each). :class:`kvrt.runtime.cell_claims.CellClaims` against the mirror it replaced, kept here
as the baseline: a list of cell ids a slot and a ``Counter`` of claims, walked cell by cell in Python.
Both leave the same number of cells used, checked in each benchmark.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest

from kvrt.runtime.cell_claims import CellClaims

SLOTS, DOCUMENT, OWN, CELLS = 64, 8192, 96, 163_840


class ListClaims:
    """The replaced mirror: each slot's cells a list, each cell's claims a ``Counter`` entry."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = [[] for _ in range(SLOTS)]
        self.refs: Counter[int] = Counter()
        self.ids = itertools.count()

    @property
    def used(self) -> int:
        return len(self.refs)

    def append(self, slot: int, n: int) -> None:
        cells = [next(self.ids) for _ in range(n)]
        self.rows[slot].extend(cells)
        self.refs.update(cells)

    def share(self, src: int, dst: int, p0: int, p1: int) -> None:
        cells = self.rows[src][p0:p1]
        self.rows[dst].extend(cells)
        self.refs.update(cells)

    def truncate(self, slot: int, keep: int) -> None:
        for cell in self.rows[slot][keep:]:
            self.refs[cell] -= 1
            if self.refs[cell] <= 0:
                del self.refs[cell]
        del self.rows[slot][keep:]


def fanout(claims: CellClaims | ListClaims) -> None:
    """The first agent prefills the document; the others share it and add their own tokens."""
    claims.append(0, DOCUMENT + OWN)
    for slot in range(1, SLOTS):
        claims.share(0, slot, 0, DOCUMENT)
        claims.append(slot, OWN)


def evict_all(claims: CellClaims | ListClaims) -> None:
    for slot in range(SLOTS):
        claims.truncate(slot, 0)


MIRRORS: dict[str, Callable[[], CellClaims | ListClaims]] = {
    "CellClaims": lambda: CellClaims(SLOTS, CELLS), "list and Counter (before)": ListClaims}


@pytest.mark.parametrize("mirror", MIRRORS, ids=list(MIRRORS))
def test_share_a_document_with_63_agents(benchmark, mirror: str) -> None:
    claims = benchmark(lambda: (fanout(made := MIRRORS[mirror]()), made)[1])
    assert claims.used == DOCUMENT + SLOTS * OWN


@pytest.mark.parametrize("mirror", MIRRORS, ids=list(MIRRORS))
def test_evict_64_slots_of_a_shared_document(benchmark, mirror: str) -> None:
    def setup() -> tuple[tuple[CellClaims | ListClaims], dict[str, object]]:
        claims = MIRRORS[mirror]()
        fanout(claims)
        return (claims,), {}

    def run(claims: CellClaims | ListClaims) -> CellClaims | ListClaims:
        evict_all(claims)
        return claims

    claims = benchmark.pedantic(run, setup=setup, rounds=10)
    assert claims.used == 0
