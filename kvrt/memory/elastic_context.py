"""Elastic llama.cpp contexts: an agent's context holds the cells its tokens need, not its maximum.

llama.cpp allocates KV for all of ``n_ctx`` when a context is created. An
:class:`ElasticContext` starts at the smallest bucket (``min_ctx * 2**k``, up to
``max_ctx``) and, when the sequence is about to outgrow it, moves the sequence state
into a context of a larger bucket (:meth:`kvrt.state.agent_context.AgentContext.move`: a
host snapshot captured from the old context, restored into the new one). ``shrink_to_fit``
moves it back down when idle; ``swap_out`` keeps the snapshot and frees the context. The
sequence, its context, its charge and its swap are an
:class:`~kvrt.state.agent_context.AgentContext`, as a scheduler's agent's are; the
buckets, the spare and growing ahead are this module's policy.

Why growth stays off the critical path: ``generate`` knows prompt + ``max_tokens``, so
it grows once, before the prefill, never while decoding; between requests
``grow_ahead`` moves to the next bucket and ``prepare`` creates the context the next
growth will need as a *spare* (creating a context, which allocates and clears its KV,
is most of a growth's cost on CUDA: bench/RESULTS.md, elastic part c). Each
:class:`Resize` records whether it ran on the path.

Invariants: every context, live or spare, is charged to the ledger *before* it is
created and released after it is closed (the ledger never under-counts; a refusal
changes nothing). At most one spare is held, only for growth; ``shrink_to_fit``,
``swap_out``, ``close`` and a growth it is too small for drop it. Restoring a state gives
the same logits as computing it, so greedy tokens equal a fixed ``max_ctx`` context's.
Everything runs on the caller's thread: llama.cpp does not promise that creating a
context is safe while another thread decodes on the same model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvrt.accounting.estimate import ModelShape
from kvrt.accounting.ledger import LedgerDenied, VramLedger
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import Completion, GenerationParams, ProgressFn, generate, prefill
from kvrt.engine.model import Model
from kvrt.errors import KvrtError
from kvrt.memory.elastic_records import Resize, Spare
from kvrt.state.agent_context import SEQ, AgentContext
from kvrt.state.hostpool import HostPool
from kvrt.state.sized_context import CTX_PAD, ChargedContext, bucket


@dataclass
class _HeldSpare:
    """The spare context held ready and its record in :attr:`ElasticContext.spares`."""

    sized: ChargedContext
    record: Spare


class ElasticContext:
    """One sequence in a llama.cpp context sized to what it holds (see the module docstring).

    ``params`` supplies every other context parameter (``n_ctx`` and ``n_seq_max`` are
    set here). States in transit go through ``host_pool`` buffers (pinned on a GPU
    machine). ``expected_tokens``: cells the first request is expected to need (prompt +
    ``max_tokens``); when it exceeds ``min_ctx`` a spare of that bucket is prepared at
    registration (a ledger refusal just leaves none).
    """

    def __init__(
        self,
        model: Model,
        *,
        max_ctx: int,
        min_ctx: int = 256,
        params: ContextParams | None = None,
        ledger: VramLedger | None = None,
        owner: str = "agent:elastic",
        host_pool: HostPool | None = None,
        expected_tokens: int | None = None,
    ) -> None:
        if min_ctx <= 0 or min_ctx % CTX_PAD or max_ctx < min_ctx:
            raise KvrtError(f"need min_ctx ({min_ctx}) a positive multiple of {CTX_PAD} and max_ctx ({max_ctx}) "
                            ">= min_ctx")
        self.model = model
        self.max_ctx = max_ctx
        self.min_ctx = min_ctx
        self.owner = owner
        base = replace(params or ContextParams(), n_ctx=min_ctx, n_seq_max=1, kv_unified=False)
        self._kv = AgentContext(model, ModelShape.read(model.path), base, ledger, owner, self.bucket(1),
                                pool=host_pool if host_pool is not None else HostPool())
        self._closed = False
        self.resizes: list[Resize] = []
        self.spares: list[Spare] = []  # every spare prepared, in order (the last may still be held)
        self._spare: _HeldSpare | None = None
        self._kv.open()
        if expected_tokens is not None:
            self.prepare(expected_tokens)

    # sizes ------------------------------------------------------------------------------
    def bucket(self, n_tokens: int) -> int:
        """The smallest bucket holding ``n_tokens`` cells."""
        if n_tokens > self.max_ctx:
            raise KvrtError(f"{n_tokens} tokens exceed this agent's max_ctx of {self.max_ctx}")
        return bucket(n_tokens, self.min_ctx, self.max_ctx)

    @property
    def ctx(self) -> Context:
        """The live context (swapped-out agents are swapped back in first)."""
        if self._kv.ctx is None:
            self.swap_in()
        ctx = self._kv.ctx
        assert ctx is not None
        return ctx

    @property
    def n_ctx(self) -> int:
        """Cells of the live context (0 while swapped out)."""
        return self._kv.n_ctx if self._kv.live is not None else 0

    @property
    def n_tokens(self) -> int:
        return self._kv.n_tokens

    @property
    def charged_bytes(self) -> int:
        """Bytes charged to the ledger for this agent: the live context plus the spare, if any."""
        return (self._kv.nbytes if self._kv.live is not None else 0) + self.spare_bytes

    @property
    def spare_ctx(self) -> int:
        """Cells of the spare context held ready (0: none)."""
        return self._spare.record.n_ctx if self._spare is not None else 0

    @property
    def spare_bytes(self) -> int:
        """Bytes the held spare is charged (0: none)."""
        return self._spare.record.nbytes if self._spare is not None else 0

    def spare_held_s(self) -> float:
        """Seconds the held spare has been held so far (0.0: none)."""
        return time.perf_counter() - self._spare.record.created_at if self._spare is not None else 0.0

    def context_bytes(self, n_ctx: int) -> int:
        """What a context of ``n_ctx`` cells is charged: KV plus compute buffer, from the GGUF header."""
        return self._kv.estimate(n_ctx)

    def _growth_target(self, n_ctx: int, n_tokens: int) -> int:
        """The bucket a context of ``n_ctx`` cells grows to so it holds ``n_tokens``: at least the next bucket."""
        return self.bucket(min(max(n_tokens, 2 * n_ctx), self.max_ctx))

    # moving between sizes -------------------------------------------------------------------
    def ensure(self, n_tokens: int) -> None:
        """Make room for ``n_tokens`` cells in total, growing at least one bucket when it must grow."""
        ctx = self.ctx
        if n_tokens <= ctx.n_ctx:
            return
        self.bucket(n_tokens)  # refuses past max_ctx
        self._resize(self._growth_target(ctx.n_ctx, n_tokens))

    def prepare(self, n_tokens: int | None = None) -> int | None:
        """Between requests: create the context the next growth will need now, and keep it as a spare.

        ``n_tokens``: cells the sequence is expected to need in total (clamped to
        ``max_ctx``); ``None``: the next bucket. Returns the spare's cells, or ``None`` when
        none is needed (the live context holds ``n_tokens``, it is at ``max_ctx``, the agent
        is swapped out) or the ledger refused it; nothing changes then. A held spare at
        least as large is kept; a smaller one is replaced (the new one is charged first).
        """
        if self._kv.live is None or self.n_ctx >= self.max_ctx:
            return None
        if n_tokens is None:
            target = self._growth_target(self.n_ctx, self.n_ctx + 1)
        else:
            need = min(max(int(n_tokens), 1), self.max_ctx)
            if need <= self.n_ctx:
                return None
            target = self._growth_target(self.n_ctx, need)
        if self._spare is not None and self._spare.record.n_ctx >= target:
            return self._spare.record.n_ctx
        try:
            sized = self._kv.create(target, f"{self.owner}:spare")
        except LedgerDenied:
            return None
        self.drop_spare()
        nbytes = sized.charge.nbytes if sized.charge is not None else self.context_bytes(target)
        record = Spare(sized.ctx.n_ctx, nbytes, sized.create_s, time.perf_counter())
        self._spare = _HeldSpare(sized, record)
        self.spares.append(record)
        return record.n_ctx

    def drop_spare(self) -> int:
        """Close the spare context, if any, and return its charge; returns the bytes released."""
        if self._spare is None:
            return 0
        spare, self._spare = self._spare, None
        spare.sized.close(self._kv.ledger)
        spare.record.end("dropped", time.perf_counter())
        return spare.record.nbytes

    def grow_ahead(self, fill: float = 0.5) -> Resize | None:
        """Between requests: if the sequence holds at least ``fill`` of its context, move to the next bucket now.

        Returns the move, or ``None`` when none was needed, the context is at ``max_ctx``,
        or the ledger refused the bigger bucket (nothing changes; growth happens on demand).
        """
        if self._kv.live is None or self.n_ctx >= self.max_ctx or self.n_tokens < fill * self.n_ctx:
            return None
        try:
            self._resize(self._growth_target(self.n_ctx, self.n_ctx), on_path=False)
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
        if self._kv.live is None:
            self.swap_in()  # swapping out again captures the live state (and refuses a closed context)
        nbytes = self._kv.swap_out()
        self._kv.free()
        self.drop_spare()
        return nbytes

    def swap_in(self) -> None:
        """Restore a swapped-out sequence into a context of the bucket it needs."""
        if self._kv.live is not None:
            return
        if self._closed:
            raise KvrtError("this elastic context is closed")
        self._kv.set_size(self.bucket(max(self._kv.n_tokens, 1)))
        self._kv.open()
        self._kv.swap_in()

    def _resize(self, n_ctx: int, *, on_path: bool = True) -> None:
        """Move the sequence into a context of ``n_ctx`` cells (the held spare when it is at least that large)."""
        old_n_ctx, held = self.ctx.n_ctx, self.n_tokens
        if n_ctx < held:
            raise KvrtError(f"cannot move {held} tokens into a context of {n_ctx} cells")
        grows = n_ctx > old_n_ctx
        spare = self._spare if grows and self._spare is not None and self._spare.record.n_ctx >= n_ctx else None
        if grows and spare is None:
            self.drop_spare()  # too small to grow into, now or later: give its memory back before creating
        if spare is not None:
            self._spare = None  # taken: the move adopts it, or closes it if the move fails
        t0 = time.perf_counter()
        try:
            move = self._kv.move(n_ctx, into=spare.sized if spare is not None else None)
        except BaseException:
            if spare is not None:
                spare.record.end("dropped", time.perf_counter())
            raise
        if spare is not None:
            spare.record.end("used", t0 + move.capture_s)
        self.resizes.append(Resize(old_n_ctx, self.n_ctx, held, move.state_bytes, time.perf_counter() - t0, on_path,
                                   move.capture_s, move.create_s, move.restore_s, move.close_s, spare is not None))

    # decoding -------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], *, progress: ProgressFn | None = None) -> int:
        """Decode ``tokens`` after what the sequence holds; returns the logits row.

        The context grows once, before decoding: one move carrying only what was held.
        """
        if not tokens:
            raise KvrtError("prefill needs at least one token")
        self.ensure(self.n_tokens + len(tokens))  # also refuses past max_ctx before decoding anything
        return prefill(self.ctx, tokens, progress=progress)

    def generate(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                 *, progress: ProgressFn | None = None) -> Completion:
        """:func:`kvrt.engine.generation.generate` after one growth to hold prompt + ``max_tokens``.

        The growth counts in ``prefill_ms`` and ``first_token_ms`` (it delays the first token).
        """
        params = params or GenerationParams()
        held = self.n_tokens
        tokens = self.model.tokenize(prompt, add_special=held == 0) if isinstance(prompt, str) else list(prompt)
        needed = held + len(tokens) + params.max_tokens
        if needed > self.max_ctx:
            raise KvrtError(f"prompt ({len(tokens)} tokens) + held ({held}) + max_tokens ({params.max_tokens}) "
                            f"= {needed} exceeds max_ctx {self.max_ctx}")
        t0 = time.perf_counter()
        self.ensure(needed)  # one move, before the prefill, carrying only what was held
        growth_ms = (time.perf_counter() - t0) * 1e3
        done = generate(self.ctx, tokens, params, seq_id=SEQ, progress=progress)
        done.timings_ms["prefill_ms"] += growth_ms
        done.timings_ms["first_token_ms"] += growth_ms
        return done

    def close(self) -> None:
        self._kv.close()
        self.drop_spare()
        self._closed = True

    def __enter__(self) -> ElasticContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"n_ctx={self.n_ctx}" if self._kv.live is not None else "swapped out"
        spare = f", spare={self.spare_ctx}" if self._spare is not None else ""
        return f"ElasticContext({where}, max_ctx={self.max_ctx}, resizes={len(self.resizes)}{spare})"
