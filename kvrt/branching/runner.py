"""Decoding branches that continue a document already in a context: batched, one after another, or restored.

Why ``exact`` runs branches one after another: llama.cpp's CPU kernels are not batch
invariant. A branch decoded in one ``llama_decode`` with its siblings, or alone but with
the siblings' cells in the same KV cache, attends over another set of cells in another
order, and its float sums round differently: near-ties between the top logits then flip.
Run alone and trimmed back to the document when it ends, every branch sees exactly the
cells, at exactly the slots, that a from-scratch evaluation of document then prompt
then each generated token puts there, so its logits are that evaluation's bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvrt.branching.branch import Branch, BranchResult, branch_budget
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.decode_step import Feed, greedy_picks, step
from kvrt.engine.generation import SequenceStream
from kvrt.engine.sampling import Sampler
from kvrt.state.contextpool import ContextPool
from kvrt.state.snapshot import Snapshot


@dataclass
class _DecodingBranch:
    """A branch being decoded: its sequence, next position and tokens waiting to be decoded."""

    seq: int
    pos: int
    pending: list[int]
    sampler: Sampler
    stream: SequenceStream
    t_start: float
    prompt_tokens: int = 0
    t_first: float | None = None


def _decode_round(ctx: Context, batch: Batch, lives: list[_DecodingBranch]) -> None:
    """Decode every live branch's pending tokens (one step for all while they fit ``n_batch``, prompt chunks
    over several steps when not) and sample each branch's next token right after the step that finished it."""
    pairs = [(live, Feed(live.seq, live.pos, live.pending)) for live in lives]
    while pairs and (landed := step(ctx, batch, [feed for _, feed in pairs])):
        done = [(live, part.row) for (live, _), part in zip(pairs, landed) if part.row is not None]
        greedy = greedy_picks(ctx, [(live.sampler, row) for live, row in done])
        for live, row in done:
            live.pos += len(live.pending)
            token = greedy[row] if live.sampler.plain_greedy else live.sampler.sample(ctx, row)
            if live.t_first is None:
                live.t_first = time.perf_counter()
            live.pending = [] if live.stream.accept(token) else [token]
        pairs = [(live, feed) for live, feed in pairs if not feed.finished]


def _decode(ctx: Context, branches: Sequence[Branch], lives: list[_DecodingBranch], work: Batch) -> list[BranchResult]:
    """Decode ``lives`` together until every one has finished; their results in order."""
    results: list[BranchResult | None] = [None] * len(lives)
    while active := [live for live in lives if live.pending]:
        _decode_round(ctx, work, active)
        now = time.perf_counter()
        for i, live in enumerate(lives):
            if results[i] is None and not live.pending:
                results[i] = BranchResult(
                    branches[i].name or f"branch{i}", live.stream.completion(live.prompt_tokens),
                    ((live.t_first or now) - live.t_start) * 1e3, (now - live.t_start) * 1e3)
    return [r for r in results if r is not None]


def run_branches(ctx: Context, branches: Sequence[Branch], seqs: Sequence[int], start_pos: int, *,
                 exact: bool, t_start: float | None = None, prompts: Sequence[Sequence[int]] | None = None,
                 batch: Batch | None = None) -> list[BranchResult]:
    """Generate every branch on its sequence of ``ctx`` (each already holding ``start_pos`` tokens).

    ``exact=False`` decodes the branches together, one ``llama_decode`` per step (the
    fast way; see the module docstring for what it trades). ``exact=True`` runs them one
    after another and trims each sequence back to ``start_pos`` when its branch ends, so
    its generated cells are gone afterwards; with ``exact=False`` they stay.
    ``t_start`` is when the branch phase began (default: now); with ``exact=True`` each
    branch is timed from its own start. ``prompts`` (the branches' prompt tokens) and
    ``batch`` (capacity >= ``ctx.n_batch`` and >= the number of branches) spare
    re-tokenizing and a batch allocation.
    """
    model = ctx.model
    t0 = time.perf_counter() if t_start is None else t_start
    if prompts is None:
        prompts = [branch_budget(model, b)[0] for b in branches]
    lives = [_DecodingBranch(seq, start_pos, list(prompt),
                   Sampler(b.params.sampling, model=model),
                   SequenceStream(model, b.params), t0, start_pos + len(prompt))
             for b, seq, prompt in zip(branches, seqs, prompts)]
    need = max(ctx.n_batch, len(lives))
    work = batch if batch is not None and batch.capacity >= need else Batch(need)
    own = work is not batch
    try:
        if not exact:
            return _decode(ctx, branches, lives, work)
        results = []
        for i, live in enumerate(lives):
            if i > 0:
                live.t_start = time.perf_counter()
            results += _decode(ctx, [branches[i]], [live], work)
            ctx.seq_rm(live.seq, start_pos, -1)
        return results
    finally:
        for live in lives:
            live.sampler.close()
        if own:
            work.close()


def run_isolated(snapshot: Snapshot, branch: Branch, pool: ContextPool, *, prompt: Sequence[int] | None = None,
                 batch: Batch | None = None) -> BranchResult:
    """Restore ``snapshot`` into a pooled context and generate one branch there."""
    t0 = time.perf_counter()
    with pool.lease() as ctx:
        snapshot.restore(ctx, 0)
        restored = time.perf_counter()
        result = run_branches(ctx, [branch], [0], snapshot.n_tokens, exact=True, t_start=t0,
                              prompts=None if prompt is None else [prompt], batch=batch)[0]
    result.restore_ms = (restored - t0) * 1e3
    return result
