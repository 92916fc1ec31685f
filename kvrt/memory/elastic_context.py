"""Elastic llama.cpp contexts: an agent's context holds the cells its tokens need, not its maximum.

llama.cpp allocates KV for all of ``n_ctx`` when a context is created (seed 003: 6.5 GiB
for one small model at n_ctx=172032). An :class:`ElasticContext` starts at a small
bucket and, when the sequence is about to outgrow it (before a prompt, or when decoding
reaches the end), moves the sequence state into a context of a larger bucket
(``llama_state_seq_get_data`` / ``_set_data``), growing geometrically so the moves cost
O(final size) in total. ``shrink_to_fit`` moves it back down when idle and ``swap_out``
parks the state in host memory and frees the context.

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

Spare contexts (taking context creation off the critical path): creating a llama.cpp
context allocates and clears its KV and compute buffers, which on CUDA is most of a
growth's cost (H200, Llama-3.2-1B shape: 13.4 ms of a 14.7 ms growth to 4096 cells).
:meth:`ElasticContext.prepare` creates the context the next growth will need *now*,
between requests, on the caller's thread, and keeps it empty as a *spare*; the growth
then only moves the state (capture, restore) and closes the old context. At most one
spare is kept. It is real memory: charged to the ledger when it is created (a refusal
leaves everything as it was, and the growth falls back to creating on demand), counted
in :attr:`charged_bytes`, and recorded in :attr:`ElasticContext.spares` with its
bytes, its creation time and how long it was held. ``expected_tokens=`` at construction
prepares a spare for the first request (prompt + ``max_tokens``), so a fresh agent's
first growth also finds its context created. ``shrink_to_fit``, ``swap_out`` and
``close`` drop the spare (an idle agent gives its memory back); :meth:`drop_spare` does
it alone. A growth that needs more than the spare holds drops the spare first (it could
never be grown into afterwards) and creates its context on demand, on the path: so a
spare of the next bucket misses when the next request jumps more than one bucket, and
even a denied growth has then released the spare. Spares are for growth only: a shrink
never moves into one.

Restoring a sequence state gives the same logits as computing it (DESIGN.md facts),
so the agent's tokens equal those of a fixed context of ``max_ctx``: the tests check
greedy outputs token for token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvrt.engine.batch import Batch
from kvrt.engine.context import Context, ContextParams
from kvrt.engine.generation import Completion, GenerationParams, ProgressFn, SequenceStream
from kvrt.engine.model import Model
from kvrt.engine.sampling import Sampler
from kvrt.errors import KvrtError
from kvrt.serve.estimate import ModelShape, context_estimate
from kvrt.serve.ledger import LedgerDenied, Reservation, VramLedger
from kvrt.state.hostpool import HostBuffer, HostPool

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
    close_s: float = 0.0  # closing the old context and releasing its charge
    spare: bool = False  # the new context was a prepared spare (create_s is 0: it was created ahead)


@dataclass
class Spare:
    """One spare context: created ahead (``create_s``, off the path), then used by a growth or dropped.

    ``nbytes`` is its ledger charge (the GGUF-header estimate of KV + compute buffer);
    ``held_s`` is how long it was held before it was used or dropped (while ``outcome``
    is ``"held"``, the time so far is :meth:`ElasticContext.spare_held_s`).
    """

    n_ctx: int
    nbytes: int
    create_s: float
    created_at: float  # time.perf_counter() when it was ready
    held_s: float = 0.0
    outcome: str = "held"  # "held", "used" (a growth moved into it) or "dropped"


class ElasticContext:
    """One sequence in a llama.cpp context sized to what it holds (see the module docstring).

    ``min_ctx`` is the smallest bucket; buckets are ``min_ctx * 2**k`` up to ``max_ctx``
    (itself a bucket). ``growth`` is the factor a full context grows by at least.
    ``params`` supplies every other context parameter (``n_ctx`` and ``n_seq_max`` are
    set here). States in transit go through ``host_pool`` buffers (pinned on a GPU
    machine: ~7x the bandwidth of pageable memory there). ``size_for_generation``: ``generate``
    grows before the prefill to hold prompt + ``max_tokens`` (``False``: only the prompt, and
    decoding grows when it reaches the end -- kept for tests of that path).
    ``expected_tokens``: cells the first request is expected to need (prompt + ``max_tokens``);
    when it exceeds ``min_ctx`` a spare of that bucket is prepared here, at registration (a
    ledger refusal just leaves none).
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
        expected_tokens: int | None = None,
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
        self.resizes: list[Resize] = []
        self.spares: list[Spare] = []  # every spare prepared, in order (the last may still be held)
        self._spare: tuple[Context, Reservation | None, Spare] | None = None
        self._open(self.bucket(1))
        if expected_tokens is not None:
            self.prepare(expected_tokens)

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
        """Bytes charged to the ledger for this agent: the live context plus the spare, if any."""
        return (self._charge.nbytes if self._charge is not None else 0) + self.spare_bytes

    @property
    def spare_ctx(self) -> int:
        """Cells of the spare context held ready (0: none)."""
        return self._spare[2].n_ctx if self._spare is not None else 0

    @property
    def spare_bytes(self) -> int:
        """Bytes the held spare is charged (0: none)."""
        return self._spare[2].nbytes if self._spare is not None else 0

    def spare_held_s(self) -> float:
        """Seconds the held spare has been held so far (0.0: none)."""
        return time.perf_counter() - self._spare[2].created_at if self._spare is not None else 0.0

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
        self._resize(self._growth_target(ctx.n_ctx, n_tokens))

    def _growth_target(self, n_ctx: int, n_tokens: int) -> int:
        """The bucket a context of ``n_ctx`` cells grows to so it holds ``n_tokens`` (at least ``growth`` x)."""
        return self.bucket(min(max(n_tokens, int(n_ctx * self.growth)), self.max_ctx))

    def prepare(self, n_tokens: int | None = None) -> int | None:
        """Between requests: create the context the next growth will need now, and keep it as a spare.

        ``n_tokens``: cells the sequence is expected to need in total (held + next prompt +
        ``max_tokens``; clamped to ``max_ctx``); ``None``: the next bucket, as the next
        growth of a full context would pick. Runs on the caller's thread (never while
        another thread decodes on this model). Returns the spare's cells, or ``None`` when
        none is needed (the live context already holds ``n_tokens``, it is at ``max_ctx``,
        the agent is swapped out) or the ledger refused it -- nothing changes then, and the
        growth will create its context on demand. A held spare at least as large is kept;
        a smaller one is replaced (the new one is charged before the old is released).
        """
        if self._ctx is None or self.n_ctx >= self.max_ctx:
            return None
        if n_tokens is None:
            target = self._growth_target(self.n_ctx, self.n_ctx + 1)
        else:
            need = min(max(int(n_tokens), 1), self.max_ctx)
            if need <= self.n_ctx:
                return None
            target = self._growth_target(self.n_ctx, need)
        if self._spare is not None and self._spare[2].n_ctx >= target:
            return self._spare[2].n_ctx
        try:
            ctx, charge, create_s = self._create(target, f"{self.owner}:spare")
        except LedgerDenied:
            return None
        self.drop_spare()
        record = Spare(ctx.n_ctx, charge.nbytes if charge is not None else self.context_bytes(target), create_s,
                       time.perf_counter())
        self._spare = (ctx, charge, record)
        self.spares.append(record)
        return record.n_ctx

    def drop_spare(self) -> int:
        """Close the spare context, if any, and return its charge; returns the bytes released."""
        if self._spare is None:
            return 0
        ctx, charge, record = self._spare
        self._spare = None
        ctx.close()
        if charge is not None and self._ledger is not None:
            self._ledger.release(charge)
        record.held_s, record.outcome = time.perf_counter() - record.created_at, "dropped"
        return record.nbytes

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
        self.drop_spare()
        target = self.bucket(max(self.n_tokens, 1))
        if target < self.n_ctx:
            self._resize(target)

    def swap_out(self) -> int:
        """Keep the sequence state in host memory, free the context and its charge; returns state bytes."""
        buffer, n, held = self._capture(self.ctx)
        self._swapped = (buffer, n, held)
        self._close_ctx()
        self.drop_spare()
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
        """Move the sequence into a context of ``n_ctx`` cells (the held spare when it is at least that large)."""
        old = self.ctx
        held = old.seq_len(SEQ)
        if n_ctx < held:
            raise KvrtError(f"cannot move {held} tokens into a context of {n_ctx} cells")
        t0 = time.perf_counter()
        buffer, n, _ = self._capture(old)
        t_captured = time.perf_counter()
        grows = n_ctx > old.n_ctx
        spare = self._spare if grows and self._spare is not None and self._spare[2].n_ctx >= n_ctx else None
        if grows and spare is None:
            self.drop_spare()  # too small to grow into, now or later: give its memory back before creating
        try:
            if spare is not None:
                self._spare = None  # taken: from here on it is the new context (or closed with it on failure)
                ctx, charge, create_s = spare[0], spare[1], 0.0
            else:
                ctx, charge, create_s = self._create(n_ctx, self.owner)
            restore_s = self._load(ctx, charge, buffer.view[:n] if buffer is not None else None)
        except BaseException:
            if spare is not None:
                spare[2].held_s, spare[2].outcome = time.perf_counter() - spare[2].created_at, "dropped"
            raise
        finally:
            if buffer is not None:
                buffer.release()
        if spare is not None:
            spare[2].held_s, spare[2].outcome = t_captured - spare[2].created_at, "used"
            if charge is not None and self._ledger is not None:
                self._ledger.transfer(charge, self.owner)  # the spare's charge is now the live context's
        t_loaded = time.perf_counter()
        old_n_ctx = old.n_ctx
        self._close_ctx()
        self._ctx, self._charge = ctx, charge
        t_end = time.perf_counter()
        self.resizes.append(Resize(old_n_ctx, self.n_ctx, held, n, t_end - t0, on_path, t_captured - t0, create_s,
                                   restore_s, t_end - t_loaded, spare is not None))

    def _create(self, n_ctx: int, owner: str) -> tuple[Context, Reservation | None, float]:
        """Charge, then create an empty context of ``n_ctx`` cells; on failure nothing is kept."""
        charge = self._ledger.try_reserve(self.context_bytes(n_ctx), owner) if self._ledger is not None else None
        try:
            t0 = time.perf_counter()
            ctx = Context(self.model, replace(self._params, n_ctx=n_ctx))
            return ctx, charge, time.perf_counter() - t0
        except BaseException:
            if charge is not None and self._ledger is not None:
                self._ledger.release(charge)
            raise

    def _load(self, ctx: Context, charge: Reservation | None, state: np.ndarray | None) -> float:
        """Load ``state`` into ``ctx``; returns seconds. On failure ``ctx`` is closed and ``charge`` released."""
        try:
            t0 = time.perf_counter()
            if state is not None and state.size:
                ctx.seq_state_set(state, SEQ)
            return time.perf_counter() - t0
        except BaseException:
            ctx.close()
            if charge is not None and self._ledger is not None:
                self._ledger.release(charge)
            raise

    def _open(self, n_ctx: int, state: np.ndarray | None = None) -> None:
        """Charge, create a context of ``n_ctx`` cells and load ``state`` into it; on failure nothing is kept."""
        ctx, charge, _ = self._create(n_ctx, self.owner)
        self._load(ctx, charge, state)
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
        """:func:`kvrt.engine.generation.generate` for an elastic sequence: growth happens between steps."""
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
        self.drop_spare()
        if self._swapped is not None and self._swapped[0] is not None:
            self._swapped[0].release()
        self._swapped = None

    def __enter__(self) -> ElasticContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"n_ctx={self.n_ctx}" if self._ctx is not None else "swapped out"
        spare = f", spare={self.spare_ctx}" if self._spare is not None else ""
        return f"ElasticContext({where}, max_ctx={self.max_ctx}, resizes={len(self.resizes)}{spare})"
