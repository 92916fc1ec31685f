"""kvrt.prefixes against independent references: the radix tree against a scan of every key (what the tiers did
before it), the eviction order against a sorted list of (priority, last use)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.errors import KvrtError
from kvrt.prefixes import Eviction, PrefixTree

keys = st.lists(st.integers(0, 3), min_size=1, max_size=9)  # a small alphabet: keys share prefixes often
ops = st.lists(st.tuples(st.sampled_from(["insert", "remove"]), keys), max_size=40)


def shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(keys, min_size=1, max_size=5))
def test_tree_answers_what_a_scan_of_every_key_answers(operations, queries):
    tree: PrefixTree[tuple[int, ...]] = PrefixTree()
    reference: dict[tuple[int, ...], tuple[int, ...]] = {}
    for op, raw in operations:
        key = tuple(raw)
        if op == "insert":
            tree.insert(key, key)
            reference[key] = key
        elif key in reference:
            assert tree.remove(key) == key
            del reference[key]
        else:
            with pytest.raises(KvrtError, match="no entry"):
                tree.remove(key)
    assert len(tree) == len(reference) and dict(tree.items()) == reference
    for raw in queries:
        query = tuple(raw)
        assert (query in tree) == (query in reference) and tree.get(query) == reference.get(query)
        assert tree.prefixes(query) == sorted(((len(k), k) for k in reference if query[:len(k)] == k), reverse=True)
        expected = {k: shared(k, query) for k in reference if shared(k, query) > 0}
        found = list(tree.sharing(query))
        assert {k: n for k, n in found} == expected and len(found) == len(expected)  # each entry once, right count
        order = [(-n, len(k)) for k, n in found]
        assert order == sorted(order)  # most shared first, shorter keys first among equals
        best = max(expected.values(), default=0)
        value, length = tree.longest(query)
        assert length == best and (value is None) == (best == 0)
        if value is not None:
            assert len(value) == min(len(k) for k, n in expected.items() if n == best)


def test_tree_walks_numpy_keys_and_splits_and_merges_edges():
    import numpy as np

    tree: PrefixTree[str] = PrefixTree()
    tree.insert(np.arange(100), "long")
    tree.insert(list(range(50)), "half")  # splits the one edge at 50
    tree.insert(list(range(50)) + [7], "branch")
    assert tree.longest(np.arange(80)) == ("long", 80) and tree.prefixes(range(60)) == [(50, "half")]
    tree.remove(range(50))
    tree.remove(list(range(50)) + [7])  # the split node is merged back: one edge again
    assert len(tree) == 1 and tree.longest([0, 1, 9]) == ("long", 2) and tree.longest([5]) == (None, 0)


priorities = st.integers(0, 2)
eviction_ops = st.lists(st.tuples(st.sampled_from(["add", "touch", "discard", "pin", "unpin"]), st.integers(0, 5),
                                  priorities), max_size=40)


@settings(max_examples=300, deadline=None)
@given(eviction_ops)
def test_eviction_order_is_priority_then_least_recent_never_pinned(operations):
    policy: Eviction[int] = Eviction()
    held: dict[int, list[int]] = {}  # key -> [priority, last use]
    pinned: set[int] = set()
    for clock, (op, key, priority) in enumerate(operations):
        if op == "add":
            policy.add(key, priority=priority)
            held[key] = [priority, clock]
        elif op == "touch" and key in held:
            policy.touch(key)
            held[key][1] = clock
        elif op == "discard":
            policy.discard(key)
            held.pop(key, None)
            pinned.discard(key)
        elif op == "pin" and key in held:
            policy.pin(key)
            pinned.add(key)
        elif op == "unpin" and key in pinned:
            policy.unpin(key)
            pinned.discard(key)
            held[key][1] = clock  # back as the most recently used of its priority
        elif op == "pin":
            with pytest.raises(KvrtError, match="not held"):
                policy.pin(key)
    expected = sorted((k for k in held if k not in pinned), key=lambda k: tuple(held[k]))
    assert list(policy) == expected and len(policy) == len(held)
    assert policy.victim() == (expected[0] if expected else None)
    if expected:
        assert policy.victim(avoid=expected[0]) == (expected[1] if len(expected) > 1 else None)
    assert all(policy.pinned(k) for k in pinned) and all(k in policy for k in held)
