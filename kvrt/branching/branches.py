"""Fan-out: prefill one document once, then let N branch prompts continue from it.

Two modes:

``isolated`` (SwarmKV's shape)
    the document's state is captured into a :class:`kvrt.state.snapshot.Snapshot` and every
    branch after the first restores it into its own context, leased from a
    :class:`kvrt.state.contextpool.ContextPool`; branches could run later or elsewhere. The
    first branch continues in the context that prefilled (its sequence already holds
    exactly the snapshot's state, so a restore would copy the bytes onto themselves),
    and one branch alone needs no snapshot at all. The
    branch's logits are bit-identical to a recompute of document then prompt in a
    fresh context (same chunks: llama.cpp's logits depend on the ubatch split), and so
    are later steps on the tiny test model. On Gemma 3 (sliding-window layers) later
    steps match too with ``flash_attn="off"`` or one thread; with llama.cpp's CPU
    flash-attention kernel on several threads they drift after a few tokens, because a
    restored state puts the window's cells at other slots than the prefill did and that
    kernel's split sum then runs in another order (the first token's logits stay
    bit-identical; ``kvrt demo`` explains and defaults to ``flash_attn="off"``).
``shared``
    all branches live in one context with unified KV. The document is prefilled once
    into sequence 0 and ``llama_memory_seq_cp`` makes every branch share its cells: no
    KV bytes move, but llama.cpp records every (cell, branch) pair in its bookkeeping,
    so the fork's host work follows the document's length (~90 ns a cell and branch on
    the H200's host). ``fork="during_prefill"`` (default) shares each chunk's cells as
    soon as its ``llama_decode`` returns, so on a GPU that work runs while the chunk is
    still computing and the branches start right after the prefill (on the CPU, where
    ``llama_decode`` computes before it returns, the two forks cost the same);
    ``fork="after_prefill"`` shares the whole document once the prefill is done (the
    same cells, the work in series). A third way, every branch's id on every document
    token in the prefill (llama.cpp's ``batched`` example), was measured and dropped:
    3x the ``seq_cp`` cost per branch on the H200, 6x on the CPU (bench/RESULTS.md).
    The branches decode together, one ``llama_decode`` per step. ``exact=True`` decodes
    each branch alone per step instead: slower, but llama.cpp then picks the same
    kernels as in isolated mode, whereas a mixed batch can move logits by float noise
    (greedy tokens usually agree; measured up to 0.83 on Gemma Q4_K_M, see DESIGN.md).

``mode="auto"`` picks shared whenever there are several branches and their combined
cells fit one context (and, given a ``pool``, its contexts), isolated otherwise; the
result says which and why.

Contexts: pass ``pool`` to reuse them across fan-outs (creating one costs 27-40 ms on
the H200). Isolated mode leases one-sequence contexts from it; shared mode leases one
unified-KV context with ``n_seq_max >= branches`` and ``n_ctx >= document + every
branch's prompt and max_tokens`` (build it with :func:`shared_params`) and empties it
with ``seq_rm`` on release. Without a pool each call creates its context and frees it.
``FanoutResult.contexts_created`` says how many contexts a call created.

Greedy branches are sampled by an argmax over the logits row (what llama.cpp's greedy
sampler computes, first maximum on ties, without building its 150k-entry candidate
array per token); other sampling goes through the llama.cpp sampler chain.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from kvrt.checks import INT32_MAX, check_int, check_text, prompt_tokens, shown
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context, ContextParams
from kvrt.engine.generation import Completion, GenerationParams, ProgressFn, SequenceStream, prefill
from kvrt.engine.model import Model
from kvrt.engine.sampling import Sampler
from kvrt.errors import KvrtError
from kvrt.state.contextpool import ContextPool
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot

Mode = Literal["auto", "isolated", "shared"]
MODES: tuple[str, ...] = get_args(Mode)
Fork = Literal["during_prefill", "after_prefill"]
FORKS: tuple[str, ...] = get_args(Fork)
CELL_ALIGN = 256
LLAMA_MAX_SEQ = 256  # llama.cpp's limit on the sequences of one context


class FanoutError(KvrtError):
    """A fan-out request that cannot run (empty, over budget, bad mode)."""


@dataclass(frozen=True)
class Branch:
    """One continuation of the shared document: a prompt and how to generate after it.

    Checked on construction: ``prompt`` non-empty text UTF-8 can encode, ``params`` a
    :class:`GenerationParams`, ``name`` a string.
    """

    prompt: str
    params: GenerationParams = field(default_factory=GenerationParams)
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise FanoutError(f"a branch's name must be a str, got {shown(self.name)}")
        check_text(self.prompt, f"branch {self.name!r} prompt" if self.name else "branch prompt", error=FanoutError)
        if not isinstance(self.params, GenerationParams):
            raise FanoutError(f"branch params must be a GenerationParams, got {shown(self.params)}")


@dataclass
class BranchResult:
    """A branch's completion and its timings.

    ``activation_ms`` is the branch-specific work before its first token (isolated:
    context lease + restore + prompt + first sample, the first branch only prompt +
    first sample in the prefill context; shared: prompt + first sample, counted
    from the start of the branch phase) - the seed's "branch activation latency".
    ``restore_ms`` isolates the state transfer within it.
    """

    name: str
    completion: Completion
    activation_ms: float
    total_ms: float
    restore_ms: float = 0.0  # isolated: context lease + snapshot restore, the part that moves KV bytes (0 for the
    # first branch, which continues in the context that prefilled)

    @property
    def text(self) -> str:
        return self.completion.text


@dataclass
class FanoutResult:
    mode: str
    reason: str
    exact: bool
    doc_tokens: int
    prefill_ms: float
    fork_ms: float  # isolated: snapshot capture (0 for one branch); shared: host time of every branch's seq_cp
    # (with fork="during_prefill" spent inside prefill_ms, under the GPU's compute: see fork_overlapped)
    branches: list[BranchResult]
    total_ms: float
    contexts_created: int = 0  # llama.cpp contexts this call created (0 when the pool had them ready)
    fork_overlapped: bool = False  # fork_ms was spent between prefill chunks, not after the prefill

    @property
    def texts(self) -> list[str]:
        return [b.text for b in self.branches]


@dataclass
class _Live:
    """A branch being decoded: its sequence, next position and tokens waiting to be decoded."""

    seq: int
    pos: int
    pending: list[int]
    sampler: Sampler | None  # None: greedy, an argmax over the logits row
    stream: SequenceStream
    t_start: float
    prompt_tokens: int = 0
    t_first: float | None = None

    def pick(self, ctx: Context, row: int) -> int:
        if self.sampler is None:
            # ctx.logits raises (instead of llama.cpp aborting) on a row without logits
            return int(np.argmax(ctx.logits(row)))
        return self.sampler.sample(ctx, row)


def branch_budget(model: Model, branch: Branch) -> tuple[list[int], int]:
    """The branch's prompt tokens and the cells it needs (prompt + max_tokens)."""
    tokens = model.tokenize(branch.prompt, add_special=False)
    if not tokens:
        raise FanoutError(f"branch {branch.name or branch.prompt!r} has an empty prompt")
    return tokens, len(tokens) + branch.params.max_tokens


def _align(n: int) -> int:
    return -(-n // CELL_ALIGN) * CELL_ALIGN


def isolated_params(cells: int, *, n_batch: int = 512, n_threads: int | None = None) -> ContextParams:
    """Parameters of an isolated-mode context: one sequence of ``cells`` (document + longest branch)."""
    return ContextParams(n_ctx=_align(cells), n_batch=n_batch, n_ubatch=min(n_batch, 512), n_threads=n_threads)


def shared_params(cells: int, n_seq: int, *, n_batch: int = 512, n_threads: int | None = None) -> ContextParams:
    """Parameters of a shared-mode context: unified KV, ``n_seq`` sequences, ``cells`` cells in all.

    ``cells`` must cover the document plus every branch's prompt and ``max_tokens``
    (the branches' cells are not shared, only the document's).
    """
    return ContextParams(n_ctx=_align(cells), n_batch=n_batch, n_ubatch=min(n_batch, 512), n_seq_max=n_seq,
                         kv_unified=True, n_threads=n_threads)


def _shared_misfit(pool: ContextPool, n: int, cells: int) -> str | None:
    """Why ``pool``'s contexts cannot hold ``n`` branches sharing ``cells`` cells, or None."""
    p = pool.params
    if not p.kv_unified:
        return "its contexts are not kv_unified (each sequence would have its own cells, nothing shared)"
    if p.n_seq_max < n:
        return f"its contexts hold {p.n_seq_max} sequences, {n} branches need {n}"
    if p.n_ctx < cells:
        return f"its contexts have {p.n_ctx} cells, document + every branch needs {cells}"
    return None


@contextmanager
def _context(pool: ContextPool | None, params: ContextParams, model: Model) -> Iterator[Context]:
    """A context leased from ``pool``, or (no pool) a new one freed afterwards."""
    if pool is None:
        with Context(model, params) as ctx:
            yield ctx
    else:
        with pool.lease() as ctx:
            yield ctx


def _decode_round(ctx: Context, batch: Batch, lives: list[_Live], exact: bool) -> None:
    """Decode every live branch's pending tokens and sample its next token.

    Batched: branches are packed into as few ``llama_decode`` calls as ``n_batch``
    allows. Exact: one call per branch. Logits of a row are read right after the
    decode that computed them, before the next one overwrites them.
    """
    groups: list[list[_Live]] = []
    used = ctx.n_batch
    for live in lives:
        if exact or used + len(live.pending) > ctx.n_batch:
            groups.append([])
            used = 0
        groups[-1].append(live)
        used += len(live.pending)
    for group in groups:
        if len(group) == 1 and len(group[0].pending) > ctx.n_batch:
            live = group[0]
            rows = [prefill(ctx, live.pending, seq_id=live.seq, start_pos=live.pos, batch=batch)]
        else:
            batch.clear()
            rows = [batch.add_sequence(live.pending, live.pos, live.seq) for live in group]
            ctx.decode(batch)
        for live, row in zip(group, rows):
            live.pos += len(live.pending)
            token = live.pick(ctx, row)
            if live.t_first is None:
                live.t_first = time.perf_counter()
            live.pending = [] if live.stream.accept(token) else [token]


def run_branches(ctx: Context, branches: Sequence[Branch], seqs: Sequence[int], start_pos: int, *,
                 exact: bool, t_start: float | None = None, prompts: Sequence[Sequence[int]] | None = None,
                 batch: Batch | None = None) -> list[BranchResult]:
    """Generate every branch on its sequence of ``ctx`` (each already holding ``start_pos`` tokens).

    ``prompts`` (the branches' prompt tokens) and ``batch`` (capacity >= ``ctx.n_batch``
    and >= the number of branches) spare re-tokenizing and a batch allocation.
    """
    model = ctx.model
    t0 = time.perf_counter() if t_start is None else t_start
    if prompts is None:
        prompts = [branch_budget(model, b)[0] for b in branches]
    lives = [_Live(seq, start_pos, list(prompt),
                   None if b.params.sampling.greedy else Sampler(b.params.sampling),
                   SequenceStream(model, b.params), t0, start_pos + len(prompt))
             for b, seq, prompt in zip(branches, seqs, prompts)]
    results: list[BranchResult | None] = [None] * len(lives)
    own = batch is None or batch.capacity < max(ctx.n_batch, len(lives))
    work = Batch(max(ctx.n_batch, len(lives))) if own else batch
    try:
        while active := [live for live in lives if live.pending]:
            _decode_round(ctx, work, active, exact)
            now = time.perf_counter()
            for i, live in enumerate(lives):
                if results[i] is None and not live.pending:
                    results[i] = BranchResult(
                        branches[i].name or f"branch{i}",
                        live.stream.completion(live.prompt_tokens),
                        ((live.t_first or now) - live.t_start) * 1e3, (now - live.t_start) * 1e3)
    finally:
        for live in lives:
            if live.sampler is not None:
                live.sampler.close()
        if own:
            work.close()
    return [r for r in results if r is not None]


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


def _shared_misfit_limits(n: int, cells: int, limit: int, limit_name: str) -> str | None:
    """Which hard limit keeps ``n`` branches sharing ``cells`` cells out of one context, or None."""
    reasons = []
    if n > LLAMA_MAX_SEQ:
        reasons.append(f"{n} branches need {n} sequences; llama.cpp allows at most {LLAMA_MAX_SEQ} in one context "
                       "(LLAMA_MAX_SEQ)")
    if cells > limit:
        reasons.append(f"{n} branches need {cells} cells in one context; {limit_name} allows {limit}")
    return "; ".join(reasons) or None


def _choose_mode(mode: Mode, n: int, shared_cells: int, limit: int, limit_name: str,
                 pool: ContextPool | None) -> tuple[str, str]:
    if mode == "isolated":
        return mode, "requested"
    too_big = _shared_misfit_limits(n, shared_cells, limit, limit_name)
    misfit = _shared_misfit(pool, n, shared_cells) if pool is not None else None
    if mode == "shared":
        if too_big is not None:
            raise FanoutError(f"shared mode cannot run: {too_big}")
        if misfit is not None:
            raise FanoutError(f"shared mode cannot use the context pool: {misfit} (build its parameters with "
                              f"kvrt.branching.branches.shared_params({shared_cells}, {n}))")
        return mode, "requested"
    if n == 1:
        return "isolated", "auto: one branch has nothing to share a context with"
    if too_big is not None:
        return "isolated", f"auto: {too_big}"
    if misfit is not None:
        return "isolated", f"auto: the context pool cannot share: {misfit}"
    return "shared", f"auto: {n} branches fit one context ({shared_cells} cells <= {limit})"


def _check_options(mode: object, fork: object, exact: object, n_batch: object, n_threads: object,
                   max_ctx: object, pool: object, host_pool: object, progress: object) -> None:
    """Refuse a fan-out option of the wrong kind before anything is tokenized or allocated."""
    if mode not in MODES:
        raise FanoutError(f"unknown fan-out mode {mode!r}; choose auto, isolated or shared")
    if fork not in FORKS:
        raise FanoutError(f"unknown shared-mode fork {fork!r}; choose one of {', '.join(FORKS)}")
    if not isinstance(exact, bool):
        raise FanoutError(f"exact must be a bool, got {shown(exact)}")
    check_int(n_batch, "n_batch", low=1, high=INT32_MAX, error=FanoutError)
    for name, value in (("n_threads", n_threads), ("max_ctx", max_ctx)):
        if value is not None:
            check_int(value, name, low=1, high=INT32_MAX, error=FanoutError)
    for name, value, kind in (("pool", pool, ContextPool), ("host_pool", host_pool, HostPool)):
        if value is not None and not isinstance(value, kind):
            raise FanoutError(f"{name} must be a {kind.__name__} or None, got {shown(value)}")
    if progress is not None and not callable(progress):
        raise FanoutError(f"progress must be callable or None, got {shown(progress)}")


def _branches(branches: object) -> list[Branch]:
    """The branches as :class:`Branch` objects (a str is a prompt with default parameters)."""
    if isinstance(branches, (str, bytes)) or not isinstance(branches, Sequence):
        raise FanoutError(f"branches must be a list of Branch or str, got {shown(branches)}")
    items = [b if isinstance(b, Branch) else Branch(b) for b in branches]
    if not items:
        raise FanoutError("fan-out needs at least one branch")
    return items


def fanout(model: Model, document: str | Sequence[int], branches: Sequence[Branch | str], *,
           mode: Mode = "auto", exact: bool = False, n_batch: int = 512, n_threads: int | None = None,
           max_ctx: int | None = None, pool: ContextPool | None = None, host_pool: HostPool | None = None,
           progress: ProgressFn | None = None, fork: Fork = "during_prefill") -> FanoutResult:
    """Prefill ``document`` once and generate every branch after it (see the module docstring).

    ``fork`` (shared mode): when the branches get the document's cells, chunk by chunk
    during the prefill (default) or all at once after it.

    ``max_ctx`` caps the cells of a context this call creates: a shared one (document
    + every branch) or an isolated one (document + longest branch); default: the model's
    training context (more works but stretches RoPE past what the model was trained on).
    Every argument is checked first: a refusal is a :class:`FanoutError`.
    ``pool`` lets repeated fan-outs reuse contexts: in isolated mode its sequences need
    room for document + longest branch; in shared mode it must be unified with room for
    every branch (:func:`shared_params`). Budgets are checked before any context or
    buffer is allocated; ``n_batch`` and ``n_threads`` apply only to contexts created
    without a pool.
    """
    t0 = time.perf_counter()
    _check_options(mode, fork, exact, n_batch, n_threads, max_ctx, pool, host_pool, progress)
    items = _branches(branches)
    doc = prompt_tokens(model, document, "the shared document", add_special=True, error=FanoutError)
    budgets = [branch_budget(model, b) for b in items]
    prompts = [tokens for tokens, _ in budgets]
    needs = [need for _, need in budgets]
    shared_cells = len(doc) + sum(needs)
    limit, limit_name = (max_ctx, "max_ctx") if max_ctx is not None else (
        model.n_ctx_train, "the model's training context (n_ctx_train; raise it with max_ctx)")
    chosen, reason = _choose_mode(mode, len(items), shared_cells, limit, limit_name, pool)
    created = pool.created if pool is not None else 0

    if chosen == "shared":
        params = pool.params if pool is not None else shared_params(shared_cells, len(items), n_batch=n_batch,
                                                                   n_threads=n_threads)
        with _context(pool, params, model) as ctx, Batch(max(ctx.n_batch, len(items))) as batch:
            fork_s = 0.0

            def share(p0: int, p1: int) -> None:
                nonlocal fork_s
                t = time.perf_counter()
                for seq in range(1, len(items)):
                    ctx.seq_cp(0, seq, p0, p1)
                fork_s += time.perf_counter() - t

            during = fork == "during_prefill" and len(items) > 1
            t_pre = time.perf_counter()
            prefill(ctx, doc, batch=batch, progress=progress, logits_last=False, after_chunk=share if during else None)
            t_prefilled = time.perf_counter()
            if not during:
                share(-1, -1)
            results = run_branches(ctx, items, range(len(items)), len(doc), exact=exact, t_start=t_prefilled,
                                   prompts=prompts, batch=batch)
        made = pool.created - created if pool is not None else 1
        return FanoutResult("shared", reason, exact, len(doc), (t_prefilled - t_pre) * 1e3, fork_s * 1e3,
                            results, (time.perf_counter() - t0) * 1e3, made, fork_overlapped=during)

    need = len(doc) + max(needs)
    own_pool = pool is None
    if pool is None and need > limit:
        raise FanoutError(f"isolated mode needs {need} cells for document ({len(doc)}) + longest branch "
                          f"({max(needs)}) in one context; {limit_name} allows {limit}")
    if pool is None:
        pool = ContextPool(model, isolated_params(need, n_batch=n_batch, n_threads=n_threads), max_idle=1)
    elif pool.params.n_ctx // (1 if pool.params.kv_unified else pool.params.n_seq_max) < need:
        raise FanoutError(f"the context pool's sequences have {pool.params.n_ctx} cells; document ({len(doc)}) + "
                          f"longest branch ({max(needs)}) needs {need}")
    snapshot: Snapshot | None = None
    try:
        with Batch(max(pool.params.n_batch, 1)) as batch:
            with pool.lease() as ctx:
                t_pre = time.perf_counter()
                prefill(ctx, doc, batch=batch, progress=progress, logits_last=False)
                t_fork = time.perf_counter()
                if len(items) > 1:  # the other branches restore this; the first continues right here
                    snapshot = Snapshot.capture(ctx, 0, pool=host_pool, tokens=doc)
                t_captured = time.perf_counter()
                results = run_branches(ctx, items[:1], [0], len(doc), exact=True, t_start=t_captured,
                                       prompts=prompts[:1], batch=batch)
            if snapshot is not None:
                results += [run_isolated(snapshot, b, pool, prompt=prompt, batch=batch)
                            for b, prompt in zip(items[1:], prompts[1:])]
    finally:
        if snapshot is not None:
            snapshot.release()
        made = pool.created - created
        if own_pool:
            pool.close()
    return FanoutResult("isolated", reason, True, len(doc), (t_fork - t_pre) * 1e3, (t_captured - t_fork) * 1e3,
                        results, (time.perf_counter() - t0) * 1e3, made)
