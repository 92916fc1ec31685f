"""A reusable ``llama_batch`` that Python fills in bulk through NumPy views."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrt.bindings import ffi, lib
from kvrt.errors import KvrtError
from kvrt._handle import NativeHandle, OwnsHandle


class Batch(OwnsHandle):
    """Tokens for one ``llama_decode`` call, possibly for several sequences.

    Allocated once with room for ``capacity`` tokens, each in up to ``n_seq_max``
    sequences, then cleared and refilled. The arrays are exposed as NumPy views of
    llama.cpp's own memory so a 32k-token prompt is written in one slice assignment.
    ``outputs`` maps each token that requested logits to its row in the batch, which
    is the index :meth:`kvrt.Context.logits` and samplers take.
    """

    def __init__(self, capacity: int, *, n_seq_max: int = 1) -> None:
        if capacity <= 0 or n_seq_max <= 0:
            raise KvrtError(f"batch capacity and n_seq_max must be positive (got {capacity}, {n_seq_max})")
        raw = lib().llama_batch_init(capacity, 0, n_seq_max)
        if raw.token == ffi.NULL:
            raise KvrtError(f"llama_batch_init failed for capacity={capacity}")
        self._raw = raw
        holder = ffi.new("struct llama_batch *", raw)
        self._handle = NativeHandle(holder, lambda p: lib().llama_batch_free(p[0]), "batch")
        self.capacity = capacity
        self.n_seq_max = n_seq_max
        self._token = np.frombuffer(ffi.buffer(raw.token, 4 * capacity), dtype=np.int32)
        self._pos = np.frombuffer(ffi.buffer(raw.pos, 4 * capacity), dtype=np.int32)
        self._n_seq = np.frombuffer(ffi.buffer(raw.n_seq_id, 4 * capacity), dtype=np.int32)
        self._logits = np.frombuffer(ffi.buffer(raw.logits, capacity), dtype=np.int8)
        self._seq0 = [raw.seq_id[i] for i in range(capacity)]
        self.n_tokens = 0
        self.outputs: dict[int, int] = {}
        self.seq_bounds = (0, -1)  # smallest and largest sequence id added since clear()

    @property
    def raw(self) -> object:
        """The ``llama_batch`` struct value to pass to ``llama_decode``."""
        self.ptr  # raises once freed
        self._raw.n_tokens = self.n_tokens
        return self._raw

    def clear(self) -> None:
        self.n_tokens = 0
        self.outputs = {}
        self.seq_bounds = (0, -1)

    def _note_seqs(self, low: int, high: int) -> None:
        lo, hi = self.seq_bounds
        self.seq_bounds = (low, high) if hi < lo else (min(lo, low), max(hi, high))

    def _reserve(self, n: int) -> int:
        start = self.n_tokens
        if start + n > self.capacity:
            raise KvrtError(f"batch holds {self.capacity} tokens; adding {n} to {start} would overflow it")
        self.n_tokens = start + n
        return start

    def add(self, token: int, pos: int, seq_ids: int | Sequence[int], *, logits: bool = False) -> int:
        """Append one token; returns its row. ``seq_ids`` may share the token across sequences."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        if not 0 < len(ids) <= self.n_seq_max:
            raise KvrtError(f"a token belongs to 1..{self.n_seq_max} sequences in this batch, got {len(ids)}")
        row = self._reserve(1)
        self._token[row] = token
        self._pos[row] = pos
        self._n_seq[row] = len(ids)
        for j, seq in enumerate(ids):
            self._seq0[row][j] = seq
        self._note_seqs(min(ids), max(ids))
        self._logits[row] = 1 if logits else 0
        if logits:
            self.outputs[row] = row
        return row

    def add_sequence(self, tokens: Sequence[int] | np.ndarray, start_pos: int, seq_id: int, *,
                     logits_last: bool = True) -> int:
        """Append a run of tokens of one sequence at consecutive positions.

        Returns the row of the last token (where its logits are, if requested).
        """
        arr = np.asarray(tokens, dtype=np.int32)
        n = int(arr.size)
        if n == 0:
            raise KvrtError("cannot add an empty token sequence to a batch")
        start = self._reserve(n)
        end = start + n
        self._token[start:end] = arr
        self._pos[start:end] = np.arange(start_pos, start_pos + n, dtype=np.int32)
        self._n_seq[start:end] = 1
        for row in range(start, end):
            self._seq0[row][0] = seq_id
        self._note_seqs(seq_id, seq_id)
        self._logits[start:end] = 0
        if logits_last:
            self._logits[end - 1] = 1
            self.outputs[end - 1] = end - 1
        return end - 1

    @property
    def tokens(self) -> np.ndarray:
        """The filled rows' tokens (a view: valid until the batch changes)."""
        return self._token[: self.n_tokens]

    @property
    def positions(self) -> np.ndarray:
        return self._pos[: self.n_tokens]
