"""The one decode step every generator runs: fill a batch from sequences' pending tokens, decode it, pick tokens.

Callers keep their own policy (which sequences, in which order, which sampler, what to
do with a chunk that landed): :func:`kvrt.engine.generation.prefill` and ``generate``
for one sequence, :mod:`kvrt.branching.runner` for branches, and
:class:`kvrt.runtime.batching.Engine` for many requests (it decodes the filled batch
itself, to retry after evicting cached prefixes). This module is the mechanism they
share: the batch layout, the decode, and the greedy picks of many rows in one pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.sampling import Sampler


@dataclass
class Feed:
    """Tokens one sequence still has to decode: ``tokens[done:]``, at positions ``pos + done`` onwards.

    A prompt is fed in chunks over several steps; a sampled token is a feed of one.
    ``logits``: whether the last token's logits are wanted (sampling follows it).
    """

    seq: int
    pos: int  # the position of tokens[0]
    tokens: Sequence[int]
    logits: bool = True
    done: int = 0

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    @property
    def finished(self) -> bool:
        return self.done >= len(self.tokens)

    def until(self, end: int) -> Feed:
        """This feed ending at ``tokens[end]`` (exclusive): its logits wanted only where that is still its end."""
        return Feed(self.seq, self.pos, self.tokens[:end], logits=self.logits and end >= len(self.tokens),
                    done=self.done)


@dataclass(frozen=True)
class Landed:
    """What one step put into the cache for a feed: positions ``[p0, p1)``, and the logits row of the feed's
    last token when this chunk finished the feed and logits were wanted (else ``None``)."""

    feed: Feed
    p0: int
    p1: int
    row: int | None


def fill(batch: Batch, feeds: Iterable[Feed], *, budget: int, chunk: int, by_seq: bool = False) -> list[Landed]:
    """Lay out one step: each feed in order gets its next ``min(left, chunk, budget left)`` tokens.

    Invariant: the result is a prefix of ``feeds`` (the feed in ``result[i]`` is the
    i-th feed): filling stops at the first feed that gets no token. Put one-token feeds
    (sampled tokens) first so a long prompt never delays them; ``feeds`` are not changed
    (:func:`advance` records what was decoded once the decode succeeded). ``by_seq`` lays
    the rows out in sequence order (what is chosen stays the same): with a KV stream per
    sequence llama.cpp computes a run of consecutive sequence ids in one micro-batch and
    starts another at every break in the order.
    """
    batch.clear()
    chosen = takes(feeds, budget=budget, chunk=chunk)
    landed: list[Landed | None] = [None] * len(chosen)
    order = sorted(range(len(chosen)), key=lambda i: chosen[i][0].seq) if by_seq else range(len(chosen))
    for i in order:
        feed, take = chosen[i]
        p0 = feed.pos + feed.done
        last = take == feed.left and feed.logits
        row = batch.add_sequence(feed.tokens[feed.done:feed.done + take], p0, feed.seq, logits_last=last)
        landed[i] = Landed(feed, p0, p0 + take, row if last else None)
    return [part for part in landed if part is not None]


def takes(feeds: Iterable[Feed], *, budget: int, chunk: int) -> list[tuple[Feed, int]]:
    """The tokens :func:`fill` gives each feed, in order: ``min(left, chunk, budget left)``, up to the first feed
    that gets none."""
    chosen: list[tuple[Feed, int]] = []
    for feed in feeds:
        take = min(feed.left, chunk, budget)
        if take <= 0:
            break
        chosen.append((feed, take))
        budget -= take
    return chosen


def advance(landed: Iterable[Landed]) -> None:
    """Record a successful decode: every feed's landed tokens are done."""
    for part in landed:
        part.feed.done += part.p1 - part.p0


def step(ctx: Context, batch: Batch, feeds: Sequence[Feed], *, chunk: int | None = None) -> list[Landed]:
    """Fill ``batch`` from ``feeds`` within ``ctx.n_batch`` (prompt chunks of at most ``chunk``, default
    ``n_batch``), decode it and advance the feeds; what landed (nothing when no feed had tokens left)."""
    landed = fill(batch, feeds, budget=ctx.n_batch, chunk=chunk or ctx.n_batch)
    if landed:
        ctx.decode(batch)
        advance(landed)
    return landed


def greedy_picks(ctx: Context, rows: Iterable[tuple[Sampler, int]]) -> dict[int, int]:
    """The token of every row a plain greedy sampler will pick (:attr:`Sampler.plain_greedy`), by row, from
    one argmax pass over the step's logits; other rows are left to their samplers."""
    picked = sorted({row for sampler, row in rows if sampler.plain_greedy})
    return dict(zip(picked, ctx.argmax(picked)))
