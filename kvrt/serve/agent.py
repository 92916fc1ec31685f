"""One agent's context: its history, its llama.cpp context and ledger charge, its swap state, its limit policy.

An :class:`Agent` is the scheduler's unit. Its ``transcript`` is every token of its
history, in order (prompts, and every token the model sampled, an end-of-generation
token included). Invariant, between turns: the KV cache of sequence 0 (its
:class:`~kvrt.state.agent_context.AgentContext` ``kv``: live in ``context`` or captured in
``snapshot``; or being captured: ``draining``) holds exactly ``transcript[:kv_tokens]`` at
positions ``0 .. kv_tokens - 1``, and ``transcript[kv_tokens:]`` (at most the one token
sampled last, which :func:`kvrt.engine.generation.generate` never decodes) is fed first
with the next turn. So after any number of turns, swaps and forks the agent's state is
that of its transcript, as a recompute from scratch would build it.

What happens at the context limit is the agent's :class:`ContextPolicy`: ``refuse``
(:class:`~kvrt.serve.results.ContextFull`, nothing changes), ``shift`` (the oldest tokens
after a kept prefix are dropped with ``seq_rm`` and the rest moved down with
``seq_add``; the transcript drops them too; the kept tokens' KV was computed with the
dropped ones in view, so a shifted history is llama.cpp's context shift, not a recompute of
the shorter transcript), or ``grow`` (the context starts at
``min_ctx`` cells and is moved into a larger one, at most twice what the turn needs,
charged to the ledger before it is created). A fixed context is ``min_ctx == n_ctx``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrt.engine.context import Context
from kvrt.errors import InvalidArgument
from kvrt.serve.registry import LoadedModel
from kvrt.serve.results import ContextFull
from kvrt.state.agent_context import AgentContext
from kvrt.state.sized_context import CTX_PAD, bucket, padded
from kvrt.state.snapshot import Snapshot

if TYPE_CHECKING:
    from kvrt.serve.turn import Turn
    from kvrt.state.staging import PendingSnapshot, PrefetchHandle

POLICIES = ("refuse", "shift", "grow")


def _cells(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ContextPolicy:
    """How big an agent's context may get and what happens when a turn would pass it.

    ``n_ctx``: the most cells the agent's history may occupy. ``min_ctx`` (grow only):
    the first context's size, rounded up to 256 cells. ``keep`` (shift only): tokens at
    the start that are never dropped; ``None`` keeps the first turn's prompt (at most
    half of ``n_ctx``).
    """

    mode: str = "refuse"
    n_ctx: int = 4096
    min_ctx: int | None = None
    keep: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise InvalidArgument(f"context policy must be one of {', '.join(POLICIES)}, got {self.mode!r}")
        _cells(self.n_ctx, "n_ctx")
        if self.min_ctx is not None:
            if self.mode != "grow":
                raise InvalidArgument(f"min_ctx applies to policy=grow only (policy is {self.mode})")
            if _cells(self.min_ctx, "min_ctx") > self.n_ctx:
                raise InvalidArgument(f"min_ctx {self.min_ctx} exceeds n_ctx {self.n_ctx}")
        if self.keep is not None:
            if self.mode != "shift":
                raise InvalidArgument(f"keep applies to policy=shift only (policy is {self.mode})")
            if isinstance(self.keep, bool) or not isinstance(self.keep, int) or not 0 <= self.keep < self.n_ctx:
                raise InvalidArgument(f"keep must be an integer in [0, n_ctx={self.n_ctx}), got {self.keep!r}")

    @property
    def first_ctx(self) -> int:
        """The size of the agent's first context."""
        if self.mode != "grow":
            return self.n_ctx
        return min(self.n_ctx, padded(self.min_ctx or CTX_PAD))

    def size_for(self, current: int, needed: int) -> int:
        """The context size a turn needing ``needed`` cells runs in: ``current`` when it holds them, else the
        smallest size :func:`kvrt.state.sized_context.bucket` allows from :attr:`first_ctx` (below ``2 * needed``)."""
        if self.mode != "grow" or needed <= current:
            return current
        return bucket(needed, self.first_ctx, self.n_ctx)

    def as_record(self) -> dict[str, object]:
        return {"mode": self.mode, "n_ctx": self.n_ctx, "min_ctx": self.min_ctx, "keep": self.keep}

    def first_keep(self, prompt: int) -> int | None:
        """A shifting agent's kept prefix, fixed at its first turn: ``keep``, else that turn's prompt (at most half
        of ``n_ctx``); ``None`` for the other policies."""
        if self.mode != "shift":
            return None
        return self.keep if self.keep is not None else min(prompt, self.n_ctx // 2)

    def make_room(self, who: str, held: int, unfed: int, keep: int | None, prompt: int,
                  max_tokens: int) -> tuple[int, int] | None:
        """Where a turn of ``prompt`` new tokens and ``max_tokens`` goes in an agent's history of ``held`` tokens in
        its KV plus ``unfed`` not yet: ``None`` when it fits, else (shift) ``(keep, drop)``: the history's
        ``[keep, keep + drop)`` goes; :class:`ContextFull` when it cannot run (nothing changes then)."""
        needed = held + unfed + prompt + max_tokens
        if needed <= self.n_ctx:
            return None
        why = (f"agent {who!r} holds {held + unfed} tokens; + prompt ({prompt}) + max_tokens ({max_tokens}) = "
               f"{needed} exceeds its n_ctx {self.n_ctx}")
        if self.mode != "shift":
            raise ContextFull(f"{why} (policy={self.mode}: register with policy=shift or a larger n_ctx)")
        keep = keep if keep is not None else min(prompt, self.n_ctx // 2)
        room = self.n_ctx - keep - unfed - prompt - max_tokens
        if room < 0:
            raise ContextFull(f"{why}, and keeping its first {keep} tokens leaves no room to shift into "
                              "(lower max_tokens or the prompt)")
        dropped = held - keep
        return keep, max(dropped - room, dropped // 2)  # half at once: a shift every few turns, not every turn


@dataclass
class Plan:
    """What a turn needs before it runs: the context size to hold it and the tokens to drop (shift)."""

    size: int
    drop: int = 0  # transcript[keep:keep + drop] goes
    keep: int = 0


@dataclass
class Agent:
    """One agent (see the module docstring); fields change on the scheduler's worker only."""

    agent_id: str
    entry: LoadedModel
    policy: ContextPolicy
    kv: AgentContext  # its sequence: live context and charge, or swapped-out snapshot; its size
    queue: deque[Turn] = field(default_factory=deque)
    transcript: list[int] = field(default_factory=list)
    kv_tokens: int = 0
    keep: int | None = None  # shift: resolved from the policy at the first turn
    served_tokens: int = 0
    last_used: int = 0
    requests: int = 0
    persisted: bool = False  # the state dir holds its current state
    staged: PrefetchHandle | None = None  # its snapshot being restored ahead of its turn (kvrt.serve.prefetch)
    draining: PendingSnapshot | None = None  # being swapped out on a copy thread (during another agent's turn)

    @property
    def context(self) -> Context | None:
        """The live context (``None``: swapped out or cold)."""
        return self.kv.ctx

    @property
    def snapshot(self) -> Snapshot | None:
        """Its swapped-out history (``None``: live, cold, or draining)."""
        return self.kv.snapshot

    @property
    def n_ctx(self) -> int:
        """Cells of its context (the one it has, or the next one it will get)."""
        return self.kv.n_ctx

    @property
    def context_bytes(self) -> int:
        """What its context is (or will be) charged."""
        return self.kv.nbytes

    @property
    def state(self) -> str:
        if self.context is not None:
            return "active"
        return "swapped" if self.snapshot is not None or self.draining is not None else "cold"

    @property
    def held_tokens(self) -> int:
        return len(self.transcript)

    def check(self) -> None:
        """The invariant of the module docstring, where it can be read (a live context)."""
        if self.context is not None and self.context.seq_len(0) != self.kv_tokens:
            raise AssertionError(f"agent {self.agent_id!r}: its KV holds {self.context.seq_len(0)} tokens, "
                                 f"its transcript says {self.kv_tokens}")

    def plan(self, prompt: int, max_tokens: int) -> Plan:
        """What a turn of ``prompt`` new tokens and ``max_tokens`` needs; :class:`ContextFull` when it cannot run."""
        unfed = len(self.transcript) - self.kv_tokens
        room = self.policy.make_room(self.agent_id, self.kv_tokens, unfed, self.keep, prompt, max_tokens)
        if room is None:
            return Plan(self.policy.size_for(self.n_ctx, len(self.transcript) + prompt + max_tokens))
        keep, drop = room
        return Plan(self.n_ctx, drop=drop, keep=keep)

    def shift(self, plan: Plan) -> None:
        """Drop ``transcript[keep:keep + drop]`` from the live KV and move what follows down."""
        assert self.context is not None and plan.drop > 0
        ctx, keep, drop = self.context, plan.keep, plan.drop
        ctx.seq_rm(0, keep, keep + drop)
        ctx.seq_add(0, keep + drop, -1, -drop)
        del self.transcript[keep:keep + drop]
        self.kv_tokens -= drop
        self.check()

    def resolve_keep(self, prompt: int) -> None:
        """Fix the kept prefix of a shifting agent at its first turn (see :meth:`ContextPolicy.first_keep`)."""
        if self.keep is None:
            self.keep = self.policy.first_keep(prompt)
