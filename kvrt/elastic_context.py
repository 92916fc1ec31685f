"""Elastic llama.cpp contexts: an agent's context holds the cells its tokens need, not its maximum.

llama.cpp allocates KV for all of ``n_ctx`` when a context is created (seed 003: 6.5 GiB
for one small model at n_ctx=172032). An :class:`ElasticContext` starts at a small
bucket and, when the sequence is about to outgrow it (before a prompt, or when decoding
reaches the end), moves the sequence state into a context of a larger bucket (``llama_state_seq_get_data`` / ``_set_data``), growing
geometrically so the moves cost O(final size) in total. ``shrink_to_fit`` moves it back
down when idle and ``swap_out`` parks the state in host memory and frees the context.

Keeping growth off the critical path: :meth:`ElasticContext.generate` knows the prompt's
length and ``max_tokens``, so it grows once, before the prefill, straight to the bucket
that holds prompt + generation (never again in the middle of decoding, where a move
would stall the token stream). Between requests the runtime calls
:meth:`ElasticContext.grow_ahead`: once the sequence fills ``fill`` of its context, it
moves to the next bucket then, on the agent's idle time, so the next turn usually finds
the room already there. Each :class:`Resize` records whether it was on the critical path
(inside a ``generate``/``prefill``/``ensure`` call) or ahead of it. Everything runs on
the caller's thread: creating a llama.cpp context while another thread decodes on a
context of the same model is not something llama.cpp promises to be safe.
Every size change is charged to the ledger *before* the new context is created (the
old one is released after the move), so the ledger never under-counts.

Restoring a sequence state gives the same logits as computing it (DESIGN.md facts),
so the agent's tokens equal those of a fixed context of ``max_ctx``: the tests check
greedy outputs token for token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvrt.batch import Batch
from kvrt.context import Context, ContextParams
from kvrt.errors import KvrtError
from kvrt.estimate import ModelShape, context_estimate
from kvrt.generation import Completion, GenerationParams, ProgressFn, SequenceStream
from kvrt.hostpool import HostBuffer, HostPool
from kvrt.ledger import LedgerDenied, Reservation, VramLedger
from kvrt.model import Model
from kvrt.sampling import Sampler

SEQ = 0  # an elastic context carries one sequence
CTX_PAD = 256  # llama.cpp rounds n_ctx up to a multiple of this, so buckets are multiples of it


@dataclass(frozen=True)
class Resize:
    """One move of the sequence between contexts: sizes in cells, bytes of state moved, seconds taken."""

    from_ctx: int
    to_ctx: int
    n_tokens: int
    state_bytes: int
    seconds: float
    on_path: bool = True  # False: done ahead, between requests (grow_ahead)
    capture_s: float = 0.0  # of ``seconds``: copying the state out of the old context
    create_s: float = 0.0  # creating the new context (llama.cpp allocates and clears its KV here)
    restore_s: float = 0.0  # loading the state into the new context


class ElasticContext:
    """One sequence in a llama.cpp context sized to what it holds (see the module docstring).

    ``min_ctx`` is the smallest bucket; buckets are ``min_ctx * 2**k`` up to ``max_ctx``
    (itself a bucket). ``growth`` is the factor a full context grows by at least.
    ``params`` supplies every other context parameter (``n_ctx`` and ``n_seq_max`` are
    set here). States in transit go through ``host_pool`` buffers (pinned on a GPU
    machine: ~7x the bandwidth of pageable memory there). ``size_for_generation``: ``generate``
    grows before the prefill to hold prompt + ``max_tokens`` (``False``: only the prompt, and
    decoding grows when it reaches the end -- kept for tests of that path).
    """

    def __init__(
        self,
        model: Model,
        *,
        max_ctx: int,
        min_ctx: int = 256,
        growth: float = 2.0,
        params: ContextParams | None = None,
        ledger: VramLedger | None = None,
        owner: str = "agent:elastic",
        host_pool: HostPool | None = None,
        size_for_generation: bool = True,
    ) -> None:
        if min_ctx <= 0 or min_ctx % CTX_PAD or max_ctx < min_ctx or growth <= 1.0:
            raise KvrtError(f"need min_ctx ({min_ctx}) a positive multiple of {CTX_PAD}, max_ctx ({max_ctx}) >= "
                            f"min_ctx and growth ({growth}) > 1")
        self.model = model
        self.max_ctx = max_ctx
        self.min_ctx = min_ctx
        self.growth = growth
        self.size_for_generation = size_for_generation
        self.owner = owner
        self._params = replace(params or ContextParams(), n_ctx=min_ctx, n_seq_max=1, kv_unified=False)
        self._ledger = ledger
        self._shape = ModelShape.read(model.path)
        self._charge: Reservation | None = None
        self._ctx: Context | None = None
        self._host = host_pool if host_pool is not None else HostPool()
        self._swapped: tuple[HostBuffer | None, int, int] | None = None  # (state, its bytes, tokens) when out
        self._open_s = (0.0, 0.0)  # the last _open's (create, restore) seconds
        self.resizes: list[Resize] = []
        self._open(self.bucket(1))

    # sizes ------------------------------------------------------------------------------
    def bucket(self, n_tokens: int) -> int:
        """The smallest bucket holding ``n_tokens`` cells."""
        if n_tokens > self.max_ctx:
            raise KvrtError(f"{n_tokens} tokens exceed this agent's max_ctx of {self.max_ctx}")
        size = self.min_ctx
        while size < n_tokens:
            size *= 2
        return min(size, self.max_ctx)

    @property
    def ctx(self) -> Context:
        """The live context (swapped-out agents are swapped back in first)."""
        if self._ctx is None:
            self.swap_in()
        assert self._ctx is not None
        return self._ctx

    @property
    def n_ctx(self) -> int:
        """Cells of the live context (0 while swapped out)."""
        return self._ctx.n_ctx if self._ctx is not None else 0

    @property
    def n_tokens(self) -> int:
        if self._ctx is None and self._swapped is not None:
            return self._swapped[2]
        return self.ctx.seq_len(SEQ)

    @property
    def charged_bytes(self) -> int:
        return self._charge.nbytes if self._charge is not None else 0

    def context_bytes(self, n_ctx: int) -> int:
        """What a context of ``n_ctx`` cells is charged: KV plus compute buffer, from the GGUF header."""
        return context_estimate(self._shape, n_ctx, self._params.n_ubatch).total_bytes

    # moving between sizes -------------------------------------------------------------------
    def ensure(self, n_tokens: int) -> None:
        """Make room for ``n_tokens`` cells in total, growing by at least ``growth`` when it must grow."""
        ctx = self.ctx
        if n_tokens <= ctx.n_ctx:
            return
        self.bucket(n_tokens)  # refuses past max_ctx
        self._resize(self.bucket(min(max(n_tokens, int(ctx.n_ctx * self.growth)), self.max_ctx)))

    def grow_ahead(self, fill: float = 0.5) -> Resize | None:
        """Between requests: if the sequence holds at least ``fill`` of its context, move to the next bucket now.

        Off the critical path (the agent is idle); returns the move, or ``None`` when none
        was needed, the context is already at ``max_ctx``, or the ledger refused the bigger
        bucket (nothing changes then; growth will happen on demand).
        """
        if self._ctx is None or self.n_ctx >= self.max_ctx or self.n_tokens < fill * self.n_ctx:
            return None
        try:
            self._resize(self.bucket(min(int(self.n_ctx * self.growth), self.max_ctx)), on_path=False)
        except LedgerDenied:
            return None
        return self.resizes[-1]

    def shrink_to_fit(self) -> None:
        """Move into the smallest bucket that holds what the sequence has (an idle agent's step)."""
        target = self.bucket(max(self.n_tokens, 1))
        if target < self.n_ctx:
            self._resize(target)

    def swap_out(self) -> int:
        """Keep the sequence state in host memory, free the context and its charge; returns state bytes."""
        buffer, n, held = self._capture(self.ctx)
        self._swapped = (buffer, n, held)
        self._close_ctx()
        return n

    def swap_in(self) -> None:
        """Restore a swapped-out sequence into a context of the bucket it needs."""
        if self._ctx is not None:
            return
        if self._swapped is None:
            raise KvrtError("this elastic context is closed")
        buffer, n, held = self._swapped
        self._open(self.bucket(max(held, 1)), buffer.view[:n] if buffer is not None else None)
        self._swapped = None
        if buffer is not None:
            buffer.release()

    def _capture(self, ctx: Context) -> tuple[HostBuffer | None, int, int]:
        """The sequence's state in a host buffer: (buffer or ``None`` when empty, state bytes, tokens)."""
        held = ctx.seq_len(SEQ)
        if not held:
            return None, 0, 0
        buffer = self._host.acquire(ctx.seq_state_size(SEQ))
        try:
            return buffer, ctx.seq_state_get(SEQ, buffer.view), held
        except BaseException:
            buffer.release()
            raise

    def _resize(self, n_ctx: int, *, on_path: bool = True) -> None:
        old = self.ctx
        held = old.seq_len(SEQ)
        if n_ctx < held:
            raise KvrtError(f"cannot move {held} tokens into a context of {n_ctx} cells")
        t0 = time.perf_counter()
        buffer, n, _ = self._capture(old)
        t_captured = time.perf_counter()
        old_charge, old_n_ctx = self._charge, old.n_ctx
        self._charge = None
        try:
            self._open(n_ctx, buffer.view[:n] if buffer is not None else None)
        except BaseException:
            self._charge = old_charge
            raise
        finally:
            if buffer is not None:
                buffer.release()
        old.close()
        if old_charge is not None and self._ledger is not None:
            self._ledger.release(old_charge)
        create_s, restore_s = self._open_s
        self.resizes.append(Resize(old_n_ctx, self.n_ctx, held, n, time.perf_counter() - t0, on_path,
                                   t_captured - t0, create_s, restore_s))

    def _open(self, n_ctx: int, state: np.ndarray | None = None) -> None:
        """Charge, create a context of ``n_ctx`` cells and load ``state`` into it; on failure nothing is kept."""
        charge = self._ledger.try_reserve(self.context_bytes(n_ctx), self.owner) if self._ledger is not None else None
        try:
            t0 = time.perf_counter()
            ctx = Context(self.model, replace(self._params, n_ctx=n_ctx))
            t1 = time.perf_counter()
            try:
                if state is not None and state.size:
                    ctx.seq_state_set(state, SEQ)
                self._open_s = (t1 - t0, time.perf_counter() - t1)
            except BaseException:
                ctx.close()
                raise
        except BaseException:
            if charge is not None and self._ledger is not None:
                self._ledger.release(charge)
            raise
        self._ctx, self._charge = ctx, charge

    def _close_ctx(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
        if self._charge is not None and self._ledger is not None:
            self._ledger.release(self._charge)
        self._charge = None

    # decoding -------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], *, progress: ProgressFn | None = None) -> int:
        """Decode ``tokens`` after what the sequence holds; returns the logits row.

        The prompt's length is known, so the context grows once, before decoding it: one
        move carrying only what the sequence already held, not one per bucket crossed.
        """
        if not tokens:
            raise KvrtError("prefill needs at least one token")
        self.ensure(self.n_tokens + len(tokens))  # also refuses past max_ctx before decoding anything
        total, row, begin = len(tokens), -1, 0
        with Batch(self._params.n_batch) as batch:
            while begin < total:
                pos = self.n_tokens
                chunk = min(self._params.n_batch, total - begin)
                self.ensure(pos + chunk)
                chunk = min(chunk, self.ctx.n_batch)
                batch.clear()
                row = batch.add_sequence(tokens[begin:begin + chunk], pos, SEQ, logits_last=begin + chunk == total)
                self.ctx.decode(batch)
                begin += chunk
                if progress is not None:
                    progress(begin, total)
        return row

    def generate(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                 *, progress: ProgressFn | None = None) -> Completion:
        """:func:`kvrt.generation.generate` for an elastic sequence: growth happens between steps."""
        params = params or GenerationParams()
        model = self.model
        held = self.n_tokens
        tokens = model.tokenize(prompt, add_special=held == 0) if isinstance(prompt, str) else list(prompt)
        needed = held + len(tokens) + params.max_tokens
        if needed > self.max_ctx:
            raise KvrtError(f"prompt ({len(tokens)} tokens) + held ({held}) + max_tokens ({params.max_tokens}) "
                            f"= {needed} exceeds max_ctx {self.max_ctx}")
        sampler = Sampler(params.sampling)
        stream = SequenceStream(model, params)
        t0 = time.perf_counter()
        t_first: float | None = None
        try:
            if self.size_for_generation:
                self.ensure(needed)  # one move, before the prefill, carrying only what was held
            row = self.prefill(tokens, progress=progress)
            t_prefill = time.perf_counter()
            with Batch(1) as batch:
                while True:
                    token = sampler.sample(self.ctx, row)
                    t_first = t_first or time.perf_counter()
                    if stream.accept(token):
                        break
                    pos = self.n_tokens
                    self.ensure(pos + 1)  # a move here loses only logits already sampled
                    batch.clear()
                    row = batch.add(token, pos, SEQ, logits=True)
                    self.ctx.decode(batch)
        finally:
            sampler.close()
        t_end = time.perf_counter()
        timings = {"prefill_ms": (t_prefill - t0) * 1e3, "first_token_ms": ((t_first or t_end) - t0) * 1e3,
                   "decode_ms": (t_end - t_prefill) * 1e3}
        return stream.completion(len(tokens), timings)

    def close(self) -> None:
        self._close_ctx()
        if self._swapped is not None and self._swapped[0] is not None:
            self._swapped[0].release()
        self._swapped = None

    def __enter__(self) -> ElasticContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"n_ctx={self.n_ctx}" if self._ctx is not None else "swapped out"
        return f"ElasticContext({where}, max_ctx={self.max_ctx}, resizes={len(self.resizes)})"
