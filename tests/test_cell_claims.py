"""kvrt.runtime.cell_claims against an independent reference: each slot's cells as a list of symbolic ids (a new id
for every position written, none ever reused), a cell in use while any list holds it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.errors import KvrtError
from kvrt.runtime.cell_claims import CellClaims

SLOTS, CELLS = 4, 24
slot = st.integers(0, SLOTS - 1)
edits = st.lists(st.one_of(
    st.tuples(st.just("append"), slot, st.integers(0, 9)),
    st.tuples(st.just("share"), slot, slot, st.integers(0, 12)),  # dst's whole row, then up to p1 of src's
    st.tuples(st.just("truncate"), slot, st.integers(0, 12)),
), max_size=40)


@settings(max_examples=400, deadline=None)
@given(edits, st.lists(slot, max_size=SLOTS), st.tuples(slot, st.integers(0, 12)))
def test_claims_count_what_lists_of_cells_hold(operations, slots, prefix):
    claims = CellClaims(SLOTS, CELLS)
    rows: list[list[int]] = [[] for _ in range(SLOTS)]
    fresh = itertools.count()
    for op, a, *rest in operations:
        used = len({cell for row in rows for cell in row})
        if op == "append":
            n = rest[0]
            if used + n > CELLS:  # more positions than the pool has cells: llama.cpp would have refused the decode
                with pytest.raises(KvrtError, match="out of step"):
                    claims.append(a, n)
                continue
            claims.append(a, n)
            rows[a] += [next(fresh) for _ in range(n)]
        elif op == "share":
            dst, p1 = rest[0], rest[1]
            p0 = len(rows[dst])
            if a == dst or not p0 <= p1 <= len(rows[a]):  # PrefixCache.copy_prefix's own preconditions
                continue
            if set(rows[dst]) & set(rows[a][p0:p1]):  # a cell holds one position: never in a row twice
                continue
            claims.share(a, dst, p0, p1)
            rows[dst] += rows[a][p0:p1]
        else:
            claims.truncate(a, rest[0])
            del rows[a][rest[0]:]
        assert claims.used == len({cell for row in rows for cell in row})
        assert [claims.held(s) for s in range(SLOTS)] == [len(row) for row in rows]
    kept = {cell for s in slots for cell in rows[s]} | set(rows[prefix[0]][:prefix[1]])
    assert claims.distinct(slots, prefix) == len(kept)
    assert claims.distinct(slots) == len({cell for s in slots for cell in rows[s]})


def test_a_cell_is_free_only_when_its_last_claim_goes():
    claims = CellClaims(2, 4)
    claims.append(0, 3)
    claims.share(0, 1, 0, 2)  # slot 1 claims slot 0's first two cells
    claims.truncate(0, 0)
    assert claims.used == 2  # slot 1 still holds them
    claims.append(1, 2)
    assert claims.used == 4
    with pytest.raises(KvrtError, match="0 free cells of 4"):
        claims.append(0, 1)
    claims.truncate(1, 1)
    assert claims.used == 1 and claims.distinct([0, 1]) == 1
