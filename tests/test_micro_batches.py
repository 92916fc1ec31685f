"""count_micro_batches against a token-by-token port of llama.cpp's split_simple / split_equal(sequential=true)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kvrt.engine.micro_batches import count_micro_batches, read_bytes, split_per_stream


def llama_split_equal(tokens: list[int], n_ubatch: int) -> int:
    """Micro-batches of a batch whose i-th token is in sequence ``tokens[i]``: llama_batch_allocr::split_equal with
    sequential=true, line for line over tokens (src/llama-batch.cpp)."""
    used = [False] * len(tokens)
    count = 0
    while not all(used):
        cur: list[int] = []
        for i, seq in enumerate(tokens):
            if used[i]:
                continue
            add = seq not in cur and (not cur or seq == cur[-1] + 1)
            if add:
                cur.append(seq)
                if len(cur) > n_ubatch:
                    break
        per_seq = [[i for i, s in enumerate(tokens) if s == seq and not used[i]] for seq in cur]
        taken = 0
        while all(taken < len(idx) for idx in per_seq):
            for idx in per_seq:
                used[idx[taken]] = True
            taken += 1
            if (taken + 1) * len(cur) > n_ubatch:
                break
        count += 1
    return count


rows_strategy = st.lists(st.tuples(st.integers(0, 12), st.integers(1, 40)), max_size=10).map(
    lambda rows: list({seq: (seq, n) for seq, n in rows}.values()))  # a sequence at most once


@given(rows_strategy, st.sampled_from([1, 4, 16, 64]), st.booleans())
def test_split_layout_matches_llama_cpp_token_by_token(rows, n_ubatch, sort):
    rows = sorted(rows) if sort else rows
    tokens = [seq for seq, n in rows for _ in range(n)]
    assert count_micro_batches(rows, n_ubatch, per_stream=True) == llama_split_equal(tokens, n_ubatch)


@given(rows_strategy, st.sampled_from([1, 4, 16, 64]))
def test_unified_layout_is_runs_of_n_ubatch_tokens(rows, n_ubatch):
    assert count_micro_batches(rows, n_ubatch, per_stream=False) == math.ceil(sum(n for _, n in rows) / n_ubatch)


def test_the_cases_the_engine_meets():
    decode = [(seq, 1) for seq in range(32)]
    assert count_micro_batches(decode, 512, per_stream=True) == 1  # 32 sequences decoding: one
    gap = [(seq, 1) for seq in range(32) if seq != 7]
    assert count_micro_batches(gap, 512, per_stream=True) == 2  # an idle slot in the middle: two
    mixed = sorted([(seq, 1) for seq in range(31)] + [(31, 64)])
    assert count_micro_batches(mixed, 512, per_stream=True) == 2  # a 64-token chunk beside them: one more
    assert count_micro_batches(mixed, 512, per_stream=False) == 1  # unified: one
    chunks = [(seq, 512) for seq in range(4)]
    assert count_micro_batches(chunks, 512, per_stream=True) == 4  # four chunks: 4 x 128 tokens each time


@given(rows_strategy, st.sampled_from([1, 4, 16, 64]))
def test_the_split_hands_out_every_token_once_in_runs_of_consecutive_ids(rows, n_ubatch):
    rows = sorted(rows)
    parts = split_per_stream(rows, n_ubatch)
    totals: dict[int, int] = {}
    for part in parts:
        seqs = sorted(part)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one run of consecutive ids
        assert len(set(part.values())) == 1  # the same tokens from each
        for seq, n in part.items():
            totals[seq] = totals.get(seq, 0) + n
    assert totals == dict(rows)


def test_a_pad_pays_off_only_while_its_slot_is_not_much_longer_than_the_run():
    """The Qwen2.5-7B shape in F16 (15.2 GB of weights, 57 KB of K/V a cell): decode rows in slots 0 and 2 at 1k
    cells each, slot 1 idle. Padding slot 1 saves a weight pass; it costs attention over slot 1's cells for all three
    rows (one common length a micro-batch), which outweighs the pass once slot 1 holds ~90k."""
    weights, cell = 15_200_000_000, 57_344
    gap = [(0, 1), (2, 1)]
    padded = [(0, 1), (1, 1), (2, 1)]
    for slot1, pays in ((1_000, True), (30_000, True), (120_000, False)):
        held = {0: 1_000, 1: slot1, 2: 1_000}.__getitem__
        assert (read_bytes(padded, 512, held, weights, cell) < read_bytes(gap, 512, held, weights, cell)) is pays
