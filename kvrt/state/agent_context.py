"""One agent's sequence: live in a ledger-charged llama.cpp context, or swapped out to a host snapshot.

The mechanism both of kvrt's agent kinds hold: the scheduler's agents
(:mod:`kvrt.serve.agent`, whose eviction and growth policy is :mod:`kvrt.serve.residency`)
and elastic contexts (:mod:`kvrt.memory.elastic_context`, whose policy is buckets, spares and
growing ahead). What to swap, when and how far to grow is theirs; how is here.

Invariants: the sequence is sequence 0 of :attr:`AgentContext.live` or held by
:attr:`AgentContext.snapshot`, never both (:meth:`swap_in` releases the snapshot once the
context holds it); a live context is charged to the ledger under :attr:`owner` from before
it exists until after it is closed (:class:`~kvrt.state.sized_context.ChargedContext`); a
refused or failed step leaves the sequence where it was and the ledger as it was. A fixed
context is the case of a caller that never calls :meth:`move`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.accounting.ledger import VramLedger
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.model import Model
from kvrt.state.hostpool import HostPool
from kvrt.state.sized_context import ChargedContext
from kvrt.state.snapshot import Snapshot

SEQ = 0  # an agent's history is sequence 0 of its context


@dataclass(frozen=True)
class Move:
    """What one :meth:`AgentContext.move` took, in seconds, and the bytes of state it carried."""

    state_bytes: int
    capture_s: float
    create_s: float  # 0.0 when the caller handed in a context created ahead
    restore_s: float
    close_s: float


class AgentContext:
    """One sequence in a context of ``n_ctx`` cells charged ``nbytes`` (see the module docstring).

    ``params`` supplies every context parameter but ``n_ctx`` (batch sizes are capped at
    ``n_ctx``, as llama.cpp does); snapshots go through ``pool`` buffers (pinned on a GPU
    machine). ``nbytes`` starts as :meth:`estimate` and follows the charge actually held.
    """

    def __init__(self, model: Model, shape: ModelShape, params: ContextParams, ledger: VramLedger | None,
                 owner: str, n_ctx: int, *, pool: HostPool | None = None) -> None:
        self.model = model
        self.shape = shape
        self.params = params
        self.ledger = ledger
        self.owner = owner
        self.pool = pool
        self.n_ctx = n_ctx
        self.nbytes = self.estimate(n_ctx)
        self.live: ChargedContext | None = None
        self.snapshot: Snapshot | None = None

    # what it is ----------------------------------------------------------------------------
    @property
    def ctx(self) -> Context | None:
        """The live context (``None``: swapped out, or never opened)."""
        return self.live.ctx if self.live is not None else None

    @property
    def n_tokens(self) -> int:
        """Tokens the sequence holds, live or in its snapshot."""
        if self.snapshot is not None:
            return self.snapshot.n_tokens
        return self.live.ctx.seq_len(SEQ) if self.live is not None else 0

    def estimate(self, n_ctx: int) -> int:
        """What a context of ``n_ctx`` cells is charged before it exists: KV plus compute buffer (GGUF header)."""
        return context_estimate(self.shape, n_ctx, self.params.n_ubatch).total_bytes

    def params_for(self, n_ctx: int) -> ContextParams:
        batch, ubatch = min(self.params.n_batch, n_ctx), min(self.params.n_ubatch, n_ctx)
        return replace(self.params, n_ctx=n_ctx, n_batch=batch, n_ubatch=ubatch)

    # contexts ------------------------------------------------------------------------------
    def create(self, n_ctx: int, owner: str | None = None) -> ChargedContext:
        """A new empty context of ``n_ctx`` cells charged to ``owner`` (default: this agent) before it exists;
        :class:`~kvrt.accounting.ledger.LedgerDenied` creating nothing."""
        return ChargedContext.open(self.model, self.params_for(n_ctx), self.ledger, self.estimate(n_ctx),
                                   owner or self.owner)

    def set_size(self, n_ctx: int) -> None:
        """The size the next :meth:`open` creates (only while no context is live); its charge, the estimate."""
        assert self.live is None, "set_size() with a live context"
        if n_ctx != self.n_ctx:
            self.n_ctx, self.nbytes = n_ctx, self.estimate(n_ctx)

    def open(self) -> ChargedContext:
        """Make an empty live context of :attr:`n_ctx` cells charged :attr:`nbytes` (the agent must have none);
        :class:`~kvrt.accounting.ledger.LedgerDenied` creating nothing."""
        assert self.live is None, "open() with a live context"
        self.live = ChargedContext.open(self.model, self.params_for(self.n_ctx), self.ledger, self.nbytes, self.owner)
        return self.live

    def adopt(self, live: ChargedContext) -> None:
        """Take ``live`` (handed over by another agent, or a staging context) as this agent's context; its charge
        moves to :attr:`owner` and :attr:`nbytes` becomes it."""
        assert self.live is None, "adopt() with a live context"
        if live.charge is not None and self.ledger is not None:
            self.ledger.transfer(live.charge, self.owner)
        self.nbytes = live.charge.nbytes if live.charge is not None else self.estimate(live.ctx.n_ctx)
        self.live = live

    def detach(self) -> ChargedContext:
        """Give the live context away, still charged (to be adopted or closed by the taker)."""
        live, self.live = self.live, None
        assert live is not None, "detach() without a live context"
        return live

    def free(self) -> None:
        """Close the live context, then give its charge back (the sequence stays in its snapshot, if any)."""
        if self.live is not None:
            self.detach().close(self.ledger)

    # moving the sequence -------------------------------------------------------------------
    def capture(self, tokens: list[int] | None = None) -> Snapshot | None:
        """The live sequence's state in a host snapshot (``None`` when it holds no tokens); the context is unchanged."""
        ctx = self.ctx
        assert ctx is not None, "capture() without a live context"
        if not ctx.seq_len(SEQ):
            return None
        return Snapshot.capture(ctx, SEQ, tier="host", pool=self.pool, tokens=tokens)

    def swap_out(self, tokens: list[int] | None = None) -> int:
        """Capture the sequence into :attr:`snapshot` and empty the context (kept: free it, or hand it over);
        returns the bytes captured."""
        assert self.snapshot is None, "swap_out() while a snapshot is held"
        self.snapshot = self.capture(tokens)
        assert self.ctx is not None
        self.ctx.clear()
        return self.snapshot.nbytes if self.snapshot is not None else 0

    def swap_in(self) -> int:
        """Restore :attr:`snapshot` into the (empty) live context and release it; returns the bytes restored.

        On failure the live context is freed and the snapshot kept for the next attempt.
        """
        ctx = self.ctx
        assert ctx is not None, "swap_in() without a live context"
        if self.snapshot is None:
            ctx.clear()
            return 0
        try:
            self.snapshot.restore(ctx, SEQ)
        except BaseException:
            self.free()
            raise
        snapshot, self.snapshot = self.snapshot, None
        snapshot.release()
        return snapshot.nbytes

    def move(self, n_ctx: int, into: ChargedContext | None = None) -> Move:
        """Move the live sequence into a context of ``n_ctx`` cells: ``into`` (created ahead, already charged) or a
        new one, then close the old one. Both are held for the move; a refusal or failure keeps the old one live
        and closes ``into``."""
        assert self.live is not None, "move() without a live context"
        t0 = time.perf_counter()
        state = self.capture()
        t_captured = time.perf_counter()
        try:
            target = into if into is not None else self.create(n_ctx)
            t_created = time.perf_counter()
            try:
                if state is not None:
                    state.restore(target.ctx, SEQ)
            except BaseException:
                target.close(self.ledger)
                raise
        finally:
            if state is not None:
                state.release()
        t_restored = time.perf_counter()
        self.free()
        self.n_ctx = target.ctx.n_ctx
        self.adopt(target)
        return Move(state.nbytes if state is not None else 0, t_captured - t0,
                    0.0 if into is not None else t_created - t_captured, t_restored - t_created,
                    time.perf_counter() - t_restored)

    def close(self) -> None:
        """Free the context and release the snapshot: nothing of the agent is held after."""
        self.free()
        if self.snapshot is not None:
            snapshot, self.snapshot = self.snapshot, None
            snapshot.release()
