"""A radix tree over token sequences: the entry sharing the longest prefix with a prompt in one walk.

Each entry is a token sequence (its key) and a value. A lookup walks the prompt down the
tree once, comparing a whole edge at a time with NumPy, instead of comparing the prompt
with every entry (what llama-cpp-python's ``llama_cache.py`` and kvrt's tiers did: a
scan, O(entries x length) per request).

Two questions a tier asks:

* :meth:`PrefixTree.prefixes`: the entries whose keys are prefixes of the prompt (a
  snapshot resumes only from the state of exactly its tokens);
* :meth:`PrefixTree.longest`: the entry sharing the most leading tokens with the prompt,
  prefix of it or not (a slot's or a host copy's KV is truncated to what is shared).

Invariants: an edge is never empty; sibling edges start with different tokens; a node
that holds no value has at least two children (removal prunes and merges), so every
subtree holds a value and the first value under a node is found by walking down.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np

from kvrt.errors import KvrtError

V = TypeVar("V")

TokenIds = Sequence[int] | np.ndarray  # token ids as a list or tuple, or an int64 array


def common_prefix(a: TokenIds, b: TokenIds) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    # argmax stops at the first True and builds no array of every difference: admission calls this once per slot
    # for every waiting request
    first = int(differs.argmax())
    return first if differs[first] else n


class _Node(Generic[V]):
    __slots__ = ("edge", "children", "value", "has_value", "depth")

    def __init__(self, edge: np.ndarray, depth: int) -> None:
        self.edge = edge  # the tokens from the parent's end to this node's end (int64, never empty but at the root)
        self.children: dict[int, _Node[V]] = {}  # by the first token of the child's edge
        self.value: V | None = None
        self.has_value = False
        self.depth = depth  # tokens from the root to this node's end: the length of its key


class PrefixTree(Generic[V]):
    """Values keyed by token sequences, found by the prefix they share with a query."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node(np.empty(0, dtype=np.int64), 0)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, tokens: TokenIds) -> bool:
        node = self._exact(np.asarray(tokens, dtype=np.int64))
        return node is not None and node.has_value

    def get(self, tokens: TokenIds) -> V | None:
        """The value stored under exactly ``tokens``, or ``None``."""
        node = self._exact(np.asarray(tokens, dtype=np.int64))
        return node.value if node is not None and node.has_value else None

    def insert(self, tokens: TokenIds, value: V) -> None:
        """Store ``value`` under exactly ``tokens`` (replacing what was there)."""
        key = np.asarray(tokens, dtype=np.int64)
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                leaf: _Node[V] = _Node(key[pos:].copy(), len(key))
                node.children[int(key[pos])] = leaf
                node = leaf
                break
            shared = common_prefix(child.edge, key[pos:pos + len(child.edge)])
            if shared < len(child.edge):  # the key leaves (or ends inside) the child's edge: split it there
                middle: _Node[V] = _Node(child.edge[:shared].copy(), node.depth + shared)
                child.edge = child.edge[shared:].copy()
                middle.children[int(child.edge[0])] = child
                node.children[int(key[pos])] = middle
                child = middle
            node, pos = child, pos + shared
        if not node.has_value:
            self._len += 1
        node.value, node.has_value = value, True

    def remove(self, tokens: TokenIds) -> V:
        """Take the value stored under exactly ``tokens`` out; KvrtError when there is none."""
        key = np.asarray(tokens, dtype=np.int64)
        path = self._path(key)
        node = path[-1]
        if node.depth != len(key) or not node.has_value:
            raise KvrtError(f"no entry of {len(key)} tokens in this prefix tree")
        value = node.value
        node.value, node.has_value = None, False
        self._len -= 1
        self._prune(path)
        return value  # type: ignore[return-value]  # has_value held: a V

    def prefixes(self, tokens: TokenIds) -> list[tuple[int, V]]:
        """``(length, value)`` of every entry whose key is a prefix of ``tokens``, longest first."""
        path = self._path(np.asarray(tokens, dtype=np.int64))
        return [(node.depth, node.value) for node in reversed(path)  # type: ignore[misc]
                if node.has_value and node.depth <= len(tokens)]

    def longest(self, tokens: TokenIds) -> tuple[V | None, int]:
        """The entry sharing the most leading tokens with ``tokens`` and how many (``(None, 0)``: none shares
        any); among entries sharing as many, the one with the shortest key (the least to restore)."""
        return next(self.sharing(tokens), (None, 0))

    def sharing(self, tokens: TokenIds) -> Iterator[tuple[V, int]]:
        """``(value, shared)`` for every entry sharing at least one leading token with ``tokens``, most shared
        first (ties: shorter keys first). Lazy: a caller that weighs entries by more than the shared length
        (e.g. how much of each was computed cold) reads on until no later entry can win."""
        query = np.asarray(tokens, dtype=np.int64)
        path = self._path(query)
        end = path[-1]
        frontier, reach = end, end.depth
        if reach < len(query):  # the walk may go part way down one more edge
            child = end.children.get(int(query[reach]))
            if child is not None:
                frontier, reach = child, reach + common_prefix(child.edge, query[reach:reach + len(child.edge)])
        if reach == 0:
            return
        for node in self._values_under(frontier):
            yield node.value, reach  # type: ignore[misc]
        below = frontier  # the subtree read so far; the rest of a path node's subtree shares exactly its depth
        for node in reversed(path[1:]):
            if node is not below:
                for found in self._values_under(node, skip=below):
                    yield found.value, node.depth  # type: ignore[misc]
                below = node

    def items(self) -> Iterator[tuple[tuple[int, ...], V]]:
        """Every ``(key, value)``, keys as tuples, in no particular order."""
        stack: list[tuple[_Node[V], tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, key = stack.pop()
            key = key + tuple(int(t) for t in node.edge)
            if node.has_value:
                yield key, node.value  # type: ignore[misc]
            stack.extend((child, key) for child in node.children.values())

    def clear(self) -> None:
        self._root = _Node(np.empty(0, dtype=np.int64), 0)
        self._len = 0

    # -- walking ------------------------------------------------------------------------
    def _path(self, key: np.ndarray) -> list[_Node[V]]:
        """The nodes from the root whose whole keys are prefixes of ``key``, root first."""
        node, path = self._root, [self._root]
        while node.depth < len(key):
            child = node.children.get(int(key[node.depth]))
            if child is None or len(child.edge) > len(key) - node.depth \
                    or common_prefix(child.edge, key[node.depth:child.depth]) < len(child.edge):
                break
            node = child
            path.append(node)
        return path

    def _exact(self, key: np.ndarray) -> _Node[V] | None:
        node = self._path(key)[-1]
        return node if node.depth == len(key) else None

    @staticmethod
    def _values_under(top: _Node[V], *, skip: _Node[V] | None = None) -> Iterator[_Node[V]]:
        """The nodes holding values in ``top``'s subtree (``top`` too, ``skip``'s subtree not), shortest key
        first."""
        heap = [(top.depth, 0, top)]
        order = 1  # ties in depth come out in the order they went in (nodes do not compare)
        while heap:
            _, _, node = heapq.heappop(heap)
            if node.has_value:
                yield node
            for child in node.children.values():
                if child is not skip:
                    heapq.heappush(heap, (child.depth, order, child))
                    order += 1

    def _prune(self, path: list[_Node[V]]) -> None:
        """Restore the invariant after ``path[-1]`` lost its value: drop valueless leaves, merge valueless
        nodes left with one child into it."""
        for i in range(len(path) - 1, 0, -1):
            node, parent = path[i], path[i - 1]
            if node.has_value:
                return
            if not node.children:
                del parent.children[int(node.edge[0])]
                continue  # the parent may now be a valueless node with one child
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.edge = np.concatenate((node.edge, child.edge))
                parent.children[int(node.edge[0])] = child
            return
