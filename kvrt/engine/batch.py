"""A reusable ``llama_batch`` whose arrays are NumPy arrays owned by Python, filled in bulk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrt.bindings import ffi
from kvrt.errors import ClosedError, KvrtError


class Batch:
    """Tokens for one ``llama_decode`` call, possibly for several sequences.

    Allocated once with room for ``capacity`` tokens, each in up to ``n_seq_max``
    sequences, then cleared and refilled. The batch owns its arrays (NumPy, not
    ``llama_batch_init``): token, pos, n_seq_id, logits, and one contiguous int32 matrix
    ``[capacity, n_seq_max]`` of sequence ids whose rows a ``llama_seq_id *`` array
    points at. :attr:`raw` is a ``llama_batch`` struct pointing into them, so a
    32k-token prompt, or a document row shared by 50 sequences, is written by a few
    slice assignments. ``outputs`` maps each token that requested logits to its row in
    the batch, which is the index :meth:`kvrt.Context.logits` and samplers take.
    """

    def __init__(self, capacity: int, *, n_seq_max: int = 1) -> None:
        if capacity <= 0 or n_seq_max <= 0:
            raise KvrtError(f"batch capacity and n_seq_max must be positive (got {capacity}, {n_seq_max})")
        self.capacity = capacity
        self.n_seq_max = n_seq_max
        self._token = np.zeros(capacity, dtype=np.int32)
        self._pos = np.zeros(capacity, dtype=np.int32)
        self._n_seq = np.zeros(capacity, dtype=np.int32)
        self._logits = np.zeros(capacity, dtype=np.int8)
        self._seq = np.zeros((capacity, n_seq_max), dtype=np.int32)  # C-contiguous: row i at base + i * row bytes
        rows = ffi.new("llama_seq_id *[]", capacity)
        np.frombuffer(ffi.buffer(rows), dtype=np.uintp)[:] = (
            self._seq.ctypes.data + np.arange(capacity, dtype=np.uintp) * self._seq.strides[0])
        views = (ffi.from_buffer("llama_token[]", self._token), ffi.from_buffer("llama_pos[]", self._pos),
                 ffi.from_buffer("int32_t[]", self._n_seq), ffi.from_buffer("int8_t[]", self._logits))
        raw = ffi.new("struct llama_batch *")
        raw.token, raw.pos, raw.n_seq_id, raw.logits = views
        raw.embd = ffi.NULL
        raw.seq_id = rows
        self._raw = raw
        # the struct holds bare pointers: keep every buffer they point into alive as long as the batch
        self._keep: tuple[Any, ...] | None = (views, rows, self._seq)
        self.n_tokens = 0
        self.outputs: dict[int, int] = {}
        self.seq_bounds = (0, -1)  # smallest and largest sequence id added since clear()

    # -- lifetime ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._keep is None

    def _check_open(self) -> None:
        if self._keep is None:
            raise ClosedError("batch was already closed")

    def close(self) -> None:
        """Drop the arrays; any later use raises :class:`ClosedError`. Closing twice is harmless."""
        if self._keep is None:
            return
        self._keep = None
        self._raw = None
        self._token = self._pos = self._n_seq = self._logits = self._seq = None  # type: ignore[assignment]
        self.n_tokens = 0
        self.outputs = {}

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- filling ----------------------------------------------------------------------
    @property
    def raw(self) -> Any:
        """The ``llama_batch`` struct value to pass to ``llama_decode`` (points into this batch's arrays)."""
        self._check_open()
        self._raw.n_tokens = self.n_tokens
        return self._raw[0]

    def clear(self) -> None:
        self._check_open()
        self.n_tokens = 0
        self.outputs = {}
        self.seq_bounds = (0, -1)

    def _note_seqs(self, low: int, high: int) -> None:
        lo, hi = self.seq_bounds
        self.seq_bounds = (low, high) if hi < lo else (min(lo, low), max(hi, high))

    def _ids(self, seq_ids: int | Sequence[int] | np.ndarray) -> np.ndarray:
        """``seq_ids`` as an int32 array of 1..n_seq_max distinct ids (refused before anything is written)."""
        if isinstance(seq_ids, (int, np.integer)):
            return np.array([seq_ids], dtype=np.int32)
        ids = np.asarray(seq_ids, dtype=np.int32).reshape(-1)
        if not 0 < ids.size <= self.n_seq_max:
            raise KvrtError(f"a token belongs to 1..{self.n_seq_max} sequences in this batch, got {ids.size}")
        if ids.size > 1 and np.unique(ids).size != ids.size:
            raise KvrtError(f"a token cannot list a sequence twice: {ids.tolist()}")
        return ids

    def _reserve(self, n: int) -> int:
        start = self.n_tokens
        if start + n > self.capacity:
            raise KvrtError(f"batch holds {self.capacity} tokens; adding {n} to {start} would overflow it")
        self.n_tokens = start + n
        return start

    def add(self, token: int, pos: int, seq_ids: int | Sequence[int], *, logits: bool = False) -> int:
        """Append one token; returns its row. ``seq_ids`` may share the token across sequences."""
        self._check_open()
        if isinstance(seq_ids, (int, np.integer)):  # the per-token path of generation loops: no array
            row = self._reserve(1)
            self._n_seq[row] = 1
            self._seq[row, 0] = seq_ids
            self._note_seqs(int(seq_ids), int(seq_ids))
        else:
            ids = self._ids(seq_ids)
            row = self._reserve(1)
            self._n_seq[row] = ids.size
            self._seq[row, :ids.size] = ids
            self._note_seqs(int(ids.min()), int(ids.max()))
        self._token[row] = token
        self._pos[row] = pos
        self._logits[row] = 1 if logits else 0
        if logits:
            self.outputs[row] = row
        return row

    def add_sequence(self, tokens: Sequence[int] | np.ndarray, start_pos: int,
                     seq_ids: int | Sequence[int] | np.ndarray, *, logits_last: bool = True) -> int:
        """Append a run of tokens at consecutive positions, each in every sequence of ``seq_ids``.

        ``seq_ids`` is one id or up to ``n_seq_max`` distinct ids: with several, every
        token's KV cell belongs to all of them (a shared prefix decoded once, no
        ``seq_cp``). Returns the row of the last token (where its logits are, if requested).
        """
        if len(tokens) == 1 and isinstance(seq_ids, (int, np.integer)):  # a decode row: add's path, no arrays
            return self.add(int(tokens[0]), start_pos, seq_ids, logits=logits_last)
        self._check_open()
        arr = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = int(arr.size)
        if n == 0:
            raise KvrtError("cannot add an empty token sequence to a batch")
        ids = self._ids(seq_ids)
        start = self._reserve(n)
        end = start + n
        self._token[start:end] = arr
        self._pos[start:end] = np.arange(start_pos, start_pos + n, dtype=np.int32)
        self._n_seq[start:end] = ids.size
        self._seq[start:end, :ids.size] = ids  # one broadcast assignment for every row
        self._note_seqs(int(ids.min()), int(ids.max()))
        self._logits[start:end] = 0
        if logits_last:
            self._logits[end - 1] = 1
            self.outputs[end - 1] = end - 1
        return end - 1

    # -- reading ----------------------------------------------------------------------
    @property
    def tokens(self) -> np.ndarray:
        """The filled rows' tokens (a view: valid until the batch changes)."""
        self._check_open()
        return self._token[: self.n_tokens]

    @property
    def positions(self) -> np.ndarray:
        self._check_open()
        return self._pos[: self.n_tokens]

    def first_seq(self, row: int) -> int:
        """The first sequence id of a filled row (the one whose sampler llama.cpp's backend sampling uses)."""
        self._check_open()
        if not 0 <= row < self.n_tokens:
            raise KvrtError(f"row {row} is outside the batch's {self.n_tokens} filled rows")
        return int(self._seq[row, 0])

    def __repr__(self) -> str:
        if self.closed:
            return "Batch(closed)"
        return f"Batch(n_tokens={self.n_tokens}, capacity={self.capacity}, n_seq_max={self.n_seq_max})"
