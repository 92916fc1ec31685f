"""The prefix cache's second tier: slots evicted from the context kept as host copies of their sequence state.

An agent whose cached history had to leave the shared context (its cells were needed by
others) comes back by one ``llama_state_seq_set_data`` of the copy instead of a prefill
of its whole transcript. The tier holds at most ``capacity_bytes``, least recently used
out first; an entry is exactly llama.cpp's state of its token prefix, so a restore puts
the same KV back that was evicted. Where the bytes live is the allocator's choice: plain
NumPy memory by default; a server passes :meth:`kvrt.state.hostpool.HostPool.acquire`, whose
pinned buffers a GPU reads at the PCIe limit (about 7x pageable memory on the H200).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvrt.checks import check_int
from kvrt.engine.prefix_cache import common_prefix


class HostBlock(Protocol):
    """Host memory of a requested size: ``view`` is its bytes (uint8), ``release`` gives it back."""

    @property
    def view(self) -> np.ndarray: ...

    def release(self) -> None: ...


HostAllocator = Callable[[int], HostBlock]


@dataclass(frozen=True)
class _NumpyBlock:
    """The default allocator's block: NumPy memory, given back to the garbage collector."""

    view: np.ndarray

    def release(self) -> None:
        pass


def numpy_block(nbytes: int) -> HostBlock:
    return _NumpyBlock(np.empty(nbytes, dtype=np.uint8))


@dataclass(frozen=True)
class HostEntry:
    """A host copy of one slot's sequence state, holding exactly ``tokens``: the first ``nbytes`` of ``block``."""

    tokens: tuple[int, ...]
    block: HostBlock
    nbytes: int

    @property
    def state(self) -> np.ndarray:
        """llama.cpp's sequence state bytes (uint8)."""
        return self.block.view[:self.nbytes]


class HostTier:
    """Host copies of evicted slots, keyed by their tokens (a copy that is a prefix of a newer one is dropped)."""

    def __init__(self, capacity_bytes: int, *, min_tokens: int = 32, alloc: HostAllocator = numpy_block) -> None:
        self.capacity_bytes = check_int(capacity_bytes, "host tier capacity_bytes", low=0)
        self.min_tokens = check_int(min_tokens, "host tier min_tokens", low=1)
        self.alloc = alloc
        self._entries: OrderedDict[tuple[int, ...], HostEntry] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def worth_keeping(self, n_tokens: int) -> bool:
        return n_tokens >= self.min_tokens and self.capacity_bytes > 0

    def put(self, tokens: Sequence[int], block: HostBlock, nbytes: int) -> bool:
        """Keep the state of exactly ``tokens``, the first ``nbytes`` of ``block`` (the tier owns the block from
        here: it is released when dropped, or at once when the state alone exceeds the capacity: False)."""
        if nbytes > self.capacity_bytes:
            block.release()
            return False
        key = tuple(tokens)
        for old in [k for k in self._entries if len(k) <= len(key) and key[:len(k)] == k]:
            self._drop(old)  # the new copy holds all of it
        self._entries[key] = HostEntry(key, block, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def longest(self, tokens: Sequence[int]) -> tuple[HostEntry | None, int]:
        """The entry sharing the longest prefix with ``tokens``, and the length shared (marked recently used)."""
        best, best_len = None, 0
        for key, entry in self._entries.items():
            length = common_prefix(key, tokens)
            if length > best_len:
                best, best_len = entry, length
        if best is not None:
            self._entries.move_to_end(best.tokens)
        return best, best_len

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        entry.block.release()

    def clear(self) -> None:
        """Drop every entry, releasing its memory."""
        for key in list(self._entries):
            self._drop(key)
