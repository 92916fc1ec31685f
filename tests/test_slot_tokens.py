"""kvrt.runtime.slot_tokens against an independent reference: a Python list of tokens a slot, edited the same way,
its common prefixes counted element by element."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.runtime.slot_tokens import SlotTokens
from test_prefixes import shared  # the element-by-element count

SLOTS = 4
tokens = st.lists(st.integers(1, 3), max_size=12)  # a small alphabet: slots share prefixes often
edits = st.lists(st.one_of(
    st.tuples(st.just("extend"), st.integers(0, SLOTS - 1), tokens),
    st.tuples(st.just("truncate"), st.integers(0, SLOTS - 1), st.integers(0, 40)),
    st.tuples(st.just("copy"), st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1)),  # extend dst by src's tokens
), max_size=30)


@settings(max_examples=300, deadline=None)
@given(edits, st.lists(tokens, min_size=1, max_size=4))
def test_the_table_answers_what_a_list_a_slot_answers(operations, probes):
    table = SlotTokens(SLOTS, width=4)  # rows grow (and the table is copied) within a few edits
    reference: list[list[int]] = [[] for _ in range(SLOTS)]
    for op, slot, arg in operations:
        if op == "extend":
            table.extend(slot, arg)
            reference[slot] += arg
        elif op == "truncate":
            table.truncate(slot, arg)
            del reference[slot][arg:]
        else:  # a view of the table itself extends a row: the growth it may cause must not corrupt it
            table.extend(arg, table.view(slot))
            reference[arg] += reference[slot]
    for slot in range(SLOTS):
        assert table.length(slot) == len(reference[slot])
        assert table.view(slot).tolist() == reference[slot]
        assert table.view(slot, 5).tolist() == reference[slot][:5]
    for raw in probes + reference:  # each slot's own tokens too: a probe equal to a row, and prefixes of rows
        probe = np.asarray(raw, dtype=np.int64)
        assert table.common_prefixes(probe).tolist() == [shared(tuple(row), tuple(raw)) for row in reference]
        for slot in range(SLOTS):
            assert table.begins_with(slot, probe) == (reference[slot][:len(raw)] == raw)


def test_stale_entries_past_a_truncation_are_not_shared():
    table = SlotTokens(2)
    table.extend(0, [1, 2, 3, 4])
    table.truncate(0, 2)  # 3 and 4 stay in the row's memory
    assert table.common_prefixes(np.array([1, 2, 3, 4], dtype=np.int64)).tolist() == [2, 0]
    assert not table.begins_with(0, np.array([1, 2, 3], dtype=np.int64))
