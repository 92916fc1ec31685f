"""Batch's vectorised fill against the old per-row fill of a ``llama_batch_init`` batch, field by field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrt.bindings import ffi, lib
from kvrt.engine.batch import Batch
from kvrt.errors import ClosedError, KvrtError

CAPACITY, N_SEQ_MAX = 24, 5


class RowByRow:
    """The reference: llama.cpp's own ``llama_batch_init`` arrays, written one row and one id at a time."""

    def __init__(self, capacity: int, n_seq_max: int) -> None:
        self.raw = lib().llama_batch_init(capacity, 0, n_seq_max)
        self.n_tokens = 0

    def add(self, token: int, pos: int, ids: list[int], logits: bool) -> None:
        i = self.n_tokens
        self.raw.token[i] = token
        self.raw.pos[i] = pos
        self.raw.n_seq_id[i] = len(ids)
        for j, seq in enumerate(ids):
            self.raw.seq_id[i][j] = seq
        self.raw.logits[i] = 1 if logits else 0
        self.n_tokens += 1

    def free(self) -> None:
        lib().llama_batch_free(self.raw)


def fields(raw: object, n: int) -> list[tuple[int, int, tuple[int, ...], int]]:
    """Every row of a ``llama_batch`` as llama.cpp reads it: token, pos, its seq ids, logits flag."""
    return [(raw.token[i], raw.pos[i], tuple(raw.seq_id[i][j] for j in range(raw.n_seq_id[i])), raw.logits[i])
            for i in range(n)]


ids_strategy = st.one_of(st.integers(0, 40), st.lists(st.integers(0, 40), min_size=1, max_size=N_SEQ_MAX, unique=True))
op = st.tuples(st.booleans(), st.lists(st.integers(0, 1000), min_size=1, max_size=8), st.integers(0, 5000),
               ids_strategy, st.booleans())


@given(st.lists(op, max_size=6))
def test_vectorised_fill_equals_row_by_row_fill(ops) -> None:
    ref = RowByRow(CAPACITY, N_SEQ_MAX)
    try:
        with Batch(CAPACITY, n_seq_max=N_SEQ_MAX) as batch:
            for _round in range(2):  # the second round refills after clear(): no stale rows or ids leak
                batch.clear()
                ref.n_tokens = 0
                expected_outputs = {}
                for single, tokens, pos, ids, logits in ops:
                    id_list = [ids] if isinstance(ids, int) else ids
                    if ref.n_tokens + (1 if single else len(tokens)) > CAPACITY:
                        break
                    if single:
                        row = batch.add(tokens[0], pos, ids, logits=logits)
                        ref.add(tokens[0], pos, id_list, logits)
                        assert row == ref.n_tokens - 1
                    else:
                        row = batch.add_sequence(tokens, pos, ids, logits_last=logits)
                        for k, token in enumerate(tokens):
                            ref.add(token, pos + k, id_list, logits and k == len(tokens) - 1)
                        assert row == ref.n_tokens - 1
                    if logits:
                        expected_outputs[row] = row
                n = ref.n_tokens
                raw = batch.raw
                assert raw.n_tokens == batch.n_tokens == n
                assert raw.embd == ffi.NULL
                assert fields(raw, n) == fields(ref.raw, n)
                assert batch.outputs == expected_outputs
                assert batch.tokens.tolist() == [ref.raw.token[i] for i in range(n)]
                assert batch.positions.tolist() == [ref.raw.pos[i] for i in range(n)]
                seqs = [s for row in fields(ref.raw, n) for s in row[2]]
                assert batch.seq_bounds == ((min(seqs), max(seqs)) if seqs else (0, -1))
    finally:
        ref.free()


def test_rows_point_into_one_contiguous_id_matrix() -> None:
    with Batch(4, n_seq_max=3) as batch:
        raw = batch.raw
        base = int(ffi.cast("uintptr_t", raw.seq_id[0]))
        assert [int(ffi.cast("uintptr_t", raw.seq_id[i])) - base for i in range(4)] == [0, 12, 24, 36]
        batch.add_sequence(np.array([7, 8, 9]), 10, np.array([2, 0, 1]))
        assert fields(batch.raw, 3) == [(7, 10, (2, 0, 1), 0), (8, 11, (2, 0, 1), 0), (9, 12, (2, 0, 1), 1)]


def test_refusals_change_nothing_and_name_the_numbers() -> None:
    with Batch(4, n_seq_max=2) as batch:
        batch.add_sequence([1, 2], 0, [0, 1])
        before = (fields(batch.raw, 2), batch.n_tokens, dict(batch.outputs), batch.seq_bounds)
        with pytest.raises(KvrtError, match="holds 4 tokens; adding 3 to 2 would overflow"):
            batch.add_sequence([1, 2, 3], 2, 0)
        with pytest.raises(KvrtError, match=r"1\.\.2 sequences in this batch, got 3"):
            batch.add_sequence([1], 2, [0, 1, 2])
        with pytest.raises(KvrtError, match=r"1\.\.2 sequences in this batch, got 0"):
            batch.add(1, 2, [])
        with pytest.raises(KvrtError, match="twice"):
            batch.add_sequence([1], 2, [1, 1])
        with pytest.raises(KvrtError, match="empty token sequence"):
            batch.add_sequence([], 2, 0)
        assert (fields(batch.raw, 2), batch.n_tokens, dict(batch.outputs), batch.seq_bounds) == before
    with pytest.raises(KvrtError, match="must be positive"):
        Batch(0)
    with pytest.raises(KvrtError, match="must be positive"):
        Batch(4, n_seq_max=0)


def test_use_after_close_is_refused() -> None:
    batch = Batch(4)
    batch.add(1, 0, 0)
    batch.close()
    batch.close()  # twice is harmless
    assert batch.closed
    for use in (lambda: batch.raw, lambda: batch.add(1, 0, 0), lambda: batch.add_sequence([1], 0, 0),
                batch.clear, lambda: batch.tokens, lambda: batch.positions):
        with pytest.raises(ClosedError):
            use()
