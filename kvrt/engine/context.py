"""A llama.cpp inference context: KV memory, decoding, logits and state.

:class:`Context` owns one ``llama_context *``. Every call that llama.cpp could
abort the process on (a logits row that was not computed, a token outside the
vocabulary, a position past the context) is checked here first; every return code
that llama.cpp does give back becomes a :class:`kvrt.errors.KvrtError`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvrt._handle import NativeHandle, OwnsHandle
from kvrt.bindings import FLASH_ATTN, STATE_SEQ_FLAGS_NONE, capture, explain, ffi, lib
from kvrt.engine.argmax import argmax_rows
from kvrt.engine.batch import Batch
from kvrt.engine.context_params import ContextParams
from kvrt.engine.model import Model
from kvrt.errors import ContextError, DecodeError, KvrtError, StateError

_DECODE_CODES = {
    1: "no KV slot for the batch (the context is full: free sequences or use a larger n_ctx)",
    2: "aborted by the abort callback",
    -1: "invalid input batch",
}


class Context(OwnsHandle):
    """A llama.cpp context over a :class:`Model` (use as a context manager).

    Thread-safe to close: :meth:`close` on one thread while another is inside a call
    (``decode``, state, memory operations, logits) waits for that call to return; later
    calls raise :class:`kvrt.errors.ClosedError`.
    """

    def __init__(self, model: Model, params: ContextParams | None = None, **overrides: Any) -> None:
        if params is None:
            params = ContextParams(**overrides)
        elif overrides:
            raise TypeError("give either a ContextParams or keyword overrides, not both")
        self.model = model
        self.params = params
        with capture() as lines, model._handle.use() as model_ptr:
            ptr = lib().llama_init_from_model(model_ptr, params.to_c())
        if ptr == ffi.NULL:
            raise ContextError(
                "llama_init_from_model",
                explain(lines, "llama.cpp could not create the context (too large for memory?)"),
                model=model.path.name,
                **params.as_dict(),
            )
        chains: dict[int, Any] = {}  # seq -> its greedy sampler chain (sample_on_device), freed after the context

        def free(context: Any) -> None:
            lib().llama_free(context)  # first: the context points at the chains it samples with
            for chain in chains.values():
                lib().llama_sampler_free(chain)

        self._handle = NativeHandle(ptr, free, "context")
        self._borrower: weakref.ref[Any] | None = None
        self._chains = chains
        self._on_device: set[int] = set()
        self._device_rows: frozenset[int] = frozenset()  # the last decode's output rows sampled on the device
        model._adopt(self)
        self._n_vocab = model.n_vocab

    @classmethod
    def from_llama_cpp(cls, llm: Any) -> Context:
        """Borrow the context of a ``llama_cpp.Llama`` together with its model."""
        handle = NativeHandle.borrow(llm.ctx, "struct llama_context *", "context")
        self = cls.__new__(cls)
        self.model = Model.from_llama_cpp(llm)
        ptr = handle.ptr
        c_params = llm.context_params
        self.params = ContextParams(
            n_ctx=int(lib().llama_n_ctx(ptr)),
            n_batch=int(lib().llama_n_batch(ptr)),
            n_ubatch=int(lib().llama_n_ubatch(ptr)),
            n_seq_max=int(lib().llama_n_seq_max(ptr)),
            kv_unified=bool(c_params.kv_unified),
            n_threads=int(c_params.n_threads),
            flash_attn={v: k for k, v in FLASH_ATTN.items()}[int(c_params.flash_attn_type)],
            offload_kqv=bool(c_params.offload_kqv),
            swa_full=bool(c_params.swa_full),
        )
        self._handle = handle
        self._borrower = weakref.ref(llm)
        self._chains, self._on_device, self._device_rows = {}, set(), frozenset()
        self.model._adopt(self)
        self._n_vocab = self.model.n_vocab
        return self

    # -- sizes ----------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return int(lib().llama_n_ctx(self.ptr))

    @property
    def n_ctx_seq(self) -> int:
        """Cells one sequence may use (``n_ctx`` when unified, else its share)."""
        return int(lib().llama_n_ctx_seq(self.ptr))

    @property
    def n_batch(self) -> int:
        return int(lib().llama_n_batch(self.ptr))

    @property
    def n_seq_max(self) -> int:
        return int(lib().llama_n_seq_max(self.ptr))

    # -- memory (KV cache) operations -----------------------------------------------
    @property
    def _memory(self) -> Any:
        return lib().llama_get_memory(self.ptr)

    def _wrote(self) -> None:
        """kvrt changed the KV cache: a borrowed ``Llama`` forgets its cached prefix and re-evaluates next time.

        llama-cpp-python trusts ``Llama.n_tokens`` to describe the cache; after kvrt's writes it
        does not, so it is reset to 0 (its next call clears the cache from position 0 and
        evaluates its prompt): correct output at the cost of the Llama's prefix reuse.
        """
        llm = self._borrower() if self._borrower is not None else None
        if llm is not None:
            llm.n_tokens = 0

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise KvrtError(f"sequence id {seq_id} is outside [0, {self.n_seq_max}) for this context")

    def clear(self) -> None:
        """Forget every sequence (and zero the KV data)."""
        lib().llama_memory_clear(self._memory, True)
        self._wrote()

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position held for ``seq_id``, or -1 when it is empty."""
        self._check_seq(seq_id)
        return int(lib().llama_memory_seq_pos_max(self._memory, seq_id))

    def seq_pos_min(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return int(lib().llama_memory_seq_pos_min(self._memory, seq_id))

    def seq_len(self, seq_id: int) -> int:
        """Tokens held for ``seq_id`` (its next position)."""
        return self.seq_pos_max(seq_id) + 1

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Remove positions [p0, p1) of a sequence (all of it by default)."""
        self._check_seq(seq_id)
        if not lib().llama_memory_seq_rm(self._memory, seq_id, p0, p1):
            raise KvrtError(f"llama_memory_seq_rm refused a partial removal [{p0}, {p1}) of sequence {seq_id}")
        self._wrote()

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Give ``dst`` the cells of ``src`` in [p0, p1).

        Unified: ``dst`` shares those cells (metadata only, no KV copy). One stream per
        sequence: llama.cpp copies ``src``'s whole stream over ``dst``'s on the device at
        the next decode, which only a whole-sequence copy (``p0``, ``p1`` left at -1) may ask.
        """
        self._check_seq(src)
        self._check_seq(dst)
        if src == dst:
            raise KvrtError(f"cannot copy sequence {src} onto itself")
        if not self.params.kv_unified and self.n_seq_max > 1 and (p0 > 0 or p1 >= 0):
            raise KvrtError(f"llama_memory_seq_cp of positions [{p0}, {p1}) from sequence {src} to {dst}: with one "
                            "KV stream per sequence llama.cpp copies whole sequences only (p0 = p1 = -1)")
        lib().llama_memory_seq_cp(self._memory, src, dst, p0, p1)
        self._wrote()

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift the positions [p0, p1) of ``seq_id`` by ``delta`` (RoPE is re-applied on the next decode)."""
        self._check_seq(seq_id)
        if not self.can_shift:
            raise KvrtError(f"model {self.model.path.name}: llama.cpp cannot shift this context's positions")
        lib().llama_memory_seq_add(self._memory, seq_id, p0, p1, delta)
        self._wrote()

    @property
    def can_shift(self) -> bool:
        return bool(lib().llama_memory_can_shift(self._memory))

    # -- decoding ---------------------------------------------------------------------
    def _validate(self, batch: Batch) -> None:
        tokens, positions = batch.tokens, batch.positions
        if tokens.size == 0:
            raise DecodeError("llama_decode", "empty batch")
        if tokens.size > self.n_batch:
            raise DecodeError("llama_decode", f"batch of {tokens.size} tokens exceeds n_batch={self.n_batch}")
        bad = np.flatnonzero((tokens < 0) | (tokens >= self._n_vocab))
        if bad.size:
            raise DecodeError("llama_decode", f"token {int(tokens[bad[0]])} at row {int(bad[0])} is outside "
                              f"the vocabulary [0, {self._n_vocab})")
        limit = self.n_ctx_seq
        if int(positions.max()) >= limit:
            raise DecodeError(
                "llama_decode",
                f"decoding past n_ctx: position {int(positions.max())} does not fit a sequence of {limit} cells",
                n_ctx=self.n_ctx,
            )
        if self.params.backend_sampling and len(batch.outputs) > self.n_seq_max:
            raise DecodeError("llama_decode", f"{len(batch.outputs)} rows ask for logits; a context with backend "
                              f"sampling takes at most n_seq_max={self.n_seq_max} (llama.cpp would abort)")
        low, high = batch.seq_bounds
        if low < 0 or high >= self.n_seq_max:
            bad_seq = low if low < 0 else high
            raise DecodeError("llama_decode", f"sequence id {bad_seq} outside [0, {self.n_seq_max})")

    def decode(self, batch: Batch) -> None:
        """Run one batch through the model; raises :class:`DecodeError` on any failure.

        On failure llama.cpp rolls the memory back to before the call (codes 1 and -1)
        or keeps the micro-batches it finished (abort, fatal); the error says which.
        """
        self._validate(batch)
        self._device_rows = frozenset()
        with capture() as lines:
            code = int(lib().llama_decode(self.ptr, batch.raw))
        self._wrote()
        if code != 0:
            reason = _DECODE_CODES.get(code, "fatal error; finished micro-batches stay in memory")
            raise DecodeError("llama_decode", explain(lines, reason), code=code, n_tokens=batch.n_tokens)
        if self._on_device:
            self._device_rows = frozenset(row for row in batch.outputs if batch.first_seq(row) in self._on_device)

    def _check_host_row(self, row: int) -> None:
        """Refuse a row whose logits llama.cpp did not copy out (sampled on the device), or a row counted from
        the end while some were (it may be one of them)."""
        if row in self._device_rows or (row < 0 and self._device_rows):
            raise DecodeError("llama_get_logits_ith", "this row was sampled on the device (sample_on_device), or "
                              "may be: llama.cpp copied no logits for it", row=row)

    def logits(self, row: int) -> np.ndarray:
        """A copy of the logits computed for batch row ``row`` (``-1``: the last output)."""
        self._check_host_row(row)
        ptr = lib().llama_get_logits_ith(self.ptr, row)
        if ptr == ffi.NULL:
            raise DecodeError("llama_get_logits_ith", "no logits were computed for this row", row=row)
        return np.frombuffer(ffi.buffer(ptr, 4 * self._n_vocab), dtype=np.float32).copy()

    def argmax(self, rows: Sequence[int]) -> list[int]:
        """The highest-logit token of each batch row in ``rows``, first maximum on ties (what
        llama.cpp's greedy sampler picks): the device's pick for a row sampled there
        (:meth:`sample_on_device`), the others in one NumPy pass over the decode's output logits.

        Greedy decoding of many sequences needs no per-row copy of the vocabulary's logits
        nor llama.cpp's per-row candidate array (a 150k-262k entry build per token).
        """
        on_device = {row: self._sampled_token(row) for row in rows if row in self._device_rows}
        on_host = [row for row in rows if row not in on_device]
        picked = dict(zip(on_host, self._host_argmax(on_host)))
        return [on_device[row] if row in on_device else picked[row] for row in rows]

    def _sampled_token(self, row: int) -> int:
        token = int(lib().llama_get_sampled_token_ith(self.ptr, row))
        if token < 0:  # LLAMA_TOKEN_NULL: the backend could not run the sampler's argmax
            raise DecodeError("llama_get_sampled_token_ith", "llama.cpp sampled no token for this row on the "
                              "device (its backend may not run the greedy sampler: turn backend sampling off)",
                              row=row)
        return token

    def _host_argmax(self, rows: Sequence[int]) -> list[int]:
        row_bytes = 4 * self._n_vocab
        addresses = []
        for row in rows:
            self._check_host_row(row)
            ptr = lib().llama_get_logits_ith(self.ptr, row)
            if ptr == ffi.NULL:
                raise DecodeError("llama_get_logits_ith", "no logits were computed for this row", row=row)
            addresses.append(int(ffi.cast("uintptr_t", ptr)))
        if not addresses:
            return []
        base = min(addresses)
        span = (max(addresses) - base) // row_bytes + 1
        logits = np.frombuffer(ffi.buffer(ffi.cast("char *", base), span * row_bytes), dtype=np.float32)
        outputs = logits.reshape(span, self._n_vocab)
        index = [(a - base) // row_bytes for a in addresses]
        best = argmax_rows(outputs)  # outputs are the rows that asked for logits, in batch order
        return [int(best[i]) for i in index]

    def has_logits(self, row: int) -> bool:
        if row in self._device_rows or (row < 0 and self._device_rows):
            return False
        with capture():
            return bool(lib().llama_get_logits_ith(self.ptr, row) != ffi.NULL)

    @property
    def sampled_on_device(self) -> frozenset[int]:
        """The sequences whose rows the decode's graph samples (:meth:`sample_on_device`)."""
        return frozenset(self._on_device)

    @property
    def device_rows(self) -> frozenset[int]:
        """The last decode's output rows that were sampled on the device."""
        return self._device_rows

    def sample_on_device(self, seq_id: int, on: bool = True) -> None:
        """Greedy picks of ``seq_id``'s rows computed in the decode's graph (``on``), or its rows' logits copied
        out as usual (``off``); from the next :meth:`decode` on. Needs ``ContextParams.backend_sampling``.

        Each change makes llama.cpp reserve its compute graphs again at the next decode, so callers keep a
        sequence's setting while its requests allow it. A row sampled on the device has no logits here:
        :meth:`argmax` returns the device's pick, :meth:`logits` refuses it.
        """
        self._check_seq(seq_id)
        if not self.params.backend_sampling:
            raise KvrtError("sample_on_device needs a context made with ContextParams(backend_sampling=True)")
        if on == (seq_id in self._on_device):
            return
        chain = ffi.NULL
        if on:
            chain = self._chains.get(seq_id) or self._greedy_chain(seq_id)
        if not lib().llama_set_sampler(self.ptr, seq_id, chain):
            raise KvrtError(f"llama.cpp cannot run a greedy sampler for sequence {seq_id} in this context's graph "
                            "(split_mode tensor, or a backend without the sampler's operations)")
        (self._on_device.add if on else self._on_device.discard)(seq_id)

    def _greedy_chain(self, seq_id: int) -> Any:
        """A chain of one greedy sampler for ``seq_id``, kept (and freed) with the context."""
        chain = lib().llama_sampler_chain_init(lib().llama_sampler_chain_default_params())
        if chain == ffi.NULL:
            raise KvrtError("llama_sampler_chain_init returned NULL")
        self._chains[seq_id] = chain  # owned from here on, whatever follows
        greedy = lib().llama_sampler_init_greedy()
        if greedy == ffi.NULL:
            raise KvrtError("llama_sampler_init_greedy returned NULL")
        lib().llama_sampler_chain_add(chain, greedy)
        return chain

    def synchronize(self) -> None:
        lib().llama_synchronize(self.ptr)

    # -- sequence state ---------------------------------------------------------------
    def seq_state_size(self, seq_id: int, flags: int = STATE_SEQ_FLAGS_NONE) -> int:
        """Bytes needed to hold the state of ``seq_id``, as llama.cpp computes them."""
        self._check_seq(seq_id)
        return int(lib().llama_state_seq_get_size_ext(self.ptr, seq_id, flags))

    def seq_state_get(self, seq_id: int, dst: Any, flags: int = STATE_SEQ_FLAGS_NONE) -> int:
        """Write the state of ``seq_id`` into the writable buffer ``dst``; returns bytes written."""
        self._check_seq(seq_id)
        out = ffi.from_buffer("uint8_t[]", dst, require_writable=True)
        with capture() as lines:
            n = int(lib().llama_state_seq_get_data_ext(self.ptr, out, len(out), seq_id, flags))
        if n == 0:
            raise StateError("llama_state_seq_get_data_ext", explain(lines, "no state written (buffer too small?)"),
                             seq_id=seq_id, buffer_bytes=len(out), flags=flags)
        return n

    def seq_state_set(self, src: Any, seq_id: int, flags: int = STATE_SEQ_FLAGS_NONE) -> int:
        """Load a sequence state from the buffer ``src`` into ``seq_id``; returns bytes read.

        The sequence is emptied first; on failure llama.cpp leaves it empty.
        """
        self._check_seq(seq_id)
        data = ffi.from_buffer("uint8_t[]", src)
        self.seq_rm(seq_id)
        with capture() as lines:
            n = int(lib().llama_state_seq_set_data_ext(self.ptr, data, len(data), seq_id, flags))
        self._wrote()
        if n == 0:
            raise StateError("llama_state_seq_set_data_ext", explain(lines, "llama.cpp refused the state"),
                             seq_id=seq_id, n_bytes=len(data), flags=flags)
        return n

    def sequences(self) -> Iterator[int]:
        """Sequence ids that currently hold tokens."""
        return (s for s in range(self.n_seq_max) if self.seq_pos_max(s) >= 0)

    def __repr__(self) -> str:
        if self.closed:
            return "Context(closed)"
        return f"Context(n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max}, model={self.model.path.name!r})"


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` with the context's handle held (:meth:`NativeHandle.use`): a ``close()`` on another
    thread waits for it instead of freeing the context under llama.cpp."""
    @functools.wraps(method)
    def call(self: Context, *args: Any, **kwargs: Any) -> Any:
        with self._handle.use():
            return method(self, *args, **kwargs)

    return call


for _name in ("clear", "seq_pos_max", "seq_pos_min", "seq_rm", "seq_cp", "seq_add", "decode", "logits", "argmax",
              "has_logits", "sample_on_device", "synchronize", "seq_state_size", "seq_state_get", "seq_state_set"):
    setattr(Context, _name, _guarded(getattr(Context, _name)))
