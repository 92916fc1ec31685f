"""Fan-out: prefill one document once, then let N branch prompts continue from it.

Two modes:

``isolated`` (SwarmKV's shape)
    the document's state is captured into a :class:`kvrt.state.snapshot.Snapshot` and every
    branch after the first restores it into its own context, leased from a
    :class:`kvrt.state.contextpool.ContextPool`; branches could run later or elsewhere. The
    first branch continues in the context that prefilled (its sequence already holds
    exactly the snapshot's state, so a restore would copy the bytes onto themselves),
    and one branch alone needs no snapshot at all. ``exact=True`` takes no snapshot: every
    branch continues in the prefill context, one after another, each trimmed back to the
    document when it ends.
``shared``
    all branches live in one context with unified KV. The document is prefilled once
    into sequence 0 and ``llama_memory_seq_cp`` makes every branch share its cells: no
    KV bytes move, but llama.cpp records every (cell, branch) pair in its bookkeeping,
    so the fork's host work follows the document's length. ``fork="during_prefill"``
    (default) shares each chunk's cells as soon as its ``llama_decode`` returns, so on a
    GPU that work runs while the chunk is still computing and the branches start right
    after the prefill (on the CPU, where ``llama_decode`` computes before it returns, the
    two forks cost the same); ``fork="after_prefill"`` shares the whole document once the
    prefill is done (the same cells, the work in series). The branches decode together,
    one ``llama_decode`` per step. ``exact=True`` forks nothing: the branches run one
    after another in sequence 0, each trimmed back to the document when it ends
    (:func:`kvrt.branching.runner.run_branches`).

Exactness (token identity with a from-scratch evaluation, greedy): the reference is a
fresh llama.cpp context (``llama_cpp.Llama`` or a kvrt :class:`Context`) that decodes the
document, then the branch prompt, then each generated token, with the same
``flash_attn``, ``n_batch``/``n_ubatch``, ``n_threads``, ``swa_full`` and extra buffer
types (``kvrt.system.cpu.llama_cpp_llama`` opens a ``Llama`` with kvrt's verdict; the
extra buffer types' kernels round differently from the plain ones). llama.cpp's
logits depend on how tokens are split into decode calls, so that split is part of the
reference; a one-call prefill of document + prompt is a different computation.
Under those settings:

- ``exact=True`` is token-identical in either mode, with flash attention off or on: each
  branch sees exactly the cells a from-scratch evaluation holds, at the same slots.
- ``mode="isolated", exact=False`` (and any restore of a :class:`Snapshot`: from disk, in a
  :class:`kvrt.branching.pipeline.Pipeline`) is token-identical while document + branch
  fit the model's sliding window, or on a model without sliding-window layers. Past the
  window (Gemma 3's is 512 tokens) a restored branch agrees up to its first near-tie:
  llama.cpp's sequence state leaves out the cells the window masks, so the restore
  packs the window's cells at other slots than the prefill did and the attention sums
  run in another order. The first branch, which continues in the prefill context, stays
  exact. With flash attention on, past the window, more restored branches drift (that
  kernel's split sum follows the layout too).
- ``mode="shared", exact=False`` (the default whenever several branches fit one context)
  trades token identity for batched decode: llama.cpp's kernels are not batch
  invariant, so a branch decoded beside its siblings gets other float sums, and greedy
  tokens flip at near-ties between the top two logits. Every branch agrees with the
  reference up to its first near-tie; one branch alone is exact.

How many branches diverge, and what ``exact=True`` costs, is measured in bench/RESULTS.md.
Ask for ``exact=True`` when the outputs must be the reference's: the branches then decode
one at a time, and none starts before the one before it has finished.

``mode="auto"`` picks shared whenever there are several branches and their cells fit one
context (document + every branch, or with ``exact=True`` document + the longest branch;
given a ``pool``, its contexts), isolated otherwise; the result says which and why.

Contexts: pass ``pool`` to reuse them across fan-outs. Isolated mode leases
one-sequence contexts from it; shared mode leases one unified-KV context with
``n_seq_max >= branches`` and ``n_ctx >= document + every branch's prompt and
max_tokens`` (build it with :func:`shared_params`) and empties it with ``seq_rm`` on
release. Without a pool each call creates its context and frees it.
``FanoutResult.contexts_created`` says how many contexts a call created.

Cache: pass ``cache`` (a :class:`kvrt.state.snapshot_cache.SnapshotCache`, shared with
pipelines and other fan-outs) and the document's longest cached prefix of this model, in
a layout the context can take, is restored instead of prefilled (``FanoutResult.reused_tokens``);
only the rest is prefilled, then the document's state is put into the cache (unless all
of it came from there). A restored prefix is the state the run that cached it
prefilled, bit for bit, and a restore is what isolated mode's rule above says of one:
with a cache hit every branch, ``exact=True`` too, is token-identical to a reference
that decodes the cached prefix as that run cut it, then the rest, while document and
branch fit the sliding window (or on a model without one), and agrees up to its first
near-tie past it. Within that, a wholly cached document gives the tokens of a fan-out
without the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvrt.bindings import FLASH_ATTN
from kvrt.branching.branch import Branch, BranchResult, FanoutError, branch_budget
from kvrt.branching.modes import FORKS, MODES, Fork, Mode, choose_mode, isolated_params, shared_params
from kvrt.branching.runner import run_branches, run_isolated
from kvrt.checks import INT32_MAX, check_int, shown
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import ProgressFn, prefill
from kvrt.engine.model import Model
from kvrt.engine.prompt import prompt_tokens
from kvrt.state.contextpool import ContextPool
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot
from kvrt.state.snapshot_cache import SnapshotCache

__all__ = ["FORKS", "MODES", "Branch", "BranchResult", "FanoutError", "FanoutResult", "Fork", "Mode", "branch_budget",
           "fanout", "isolated_params", "run_branches", "run_isolated", "shared_params"]


@dataclass
class FanoutResult:
    """What a fan-out did: the mode it chose and why, its timings (ms) and every branch's result, in order.

    ``exact`` is whether the branches ran the exact way (``exact=True``: one after another
    in the prefill context, token-identical to a from-scratch evaluation).
    """

    mode: str
    reason: str
    exact: bool
    doc_tokens: int
    prefill_ms: float
    fork_ms: float  # isolated: snapshot capture; shared: host time of every branch's seq_cp (with
    # fork="during_prefill" spent inside prefill_ms, under the GPU's compute: see fork_overlapped); 0 with one
    # branch or exact=True, which share nothing
    branches: list[BranchResult]
    total_ms: float
    contexts_created: int = 0  # llama.cpp contexts this call created (0 when the pool had them ready)
    fork_overlapped: bool = False  # fork_ms was spent between prefill chunks, not after the prefill
    reused_tokens: int = 0  # document tokens restored from the cache instead of prefilled (inside prefill_ms)
    cache_ms: float = 0.0  # capturing the document for the cache where no branch needed the snapshot

    @property
    def texts(self) -> list[str]:
        return [b.text for b in self.branches]


@contextmanager
def _context(pool: ContextPool | None, params: ContextParams, model: Model) -> Iterator[Context]:
    """A context leased from ``pool``, or (no pool) a new one freed afterwards."""
    if pool is None:
        with Context(model, params) as ctx:
            yield ctx
    else:
        with pool.lease() as ctx:
            yield ctx


def _check_options(mode: object, fork: object, exact: object, n_batch: object, n_threads: object,
                   flash_attn: object, max_ctx: object, pool: object, host_pool: object, progress: object,
                   cache: object) -> None:
    """Refuse a fan-out option of the wrong kind before anything is tokenized or allocated."""
    if not isinstance(flash_attn, str) or flash_attn not in FLASH_ATTN:
        raise FanoutError(f"flash_attn must be one of {', '.join(sorted(FLASH_ATTN))}, got {shown(flash_attn)}")
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
    for name, value, kind in (("pool", pool, ContextPool), ("host_pool", host_pool, HostPool),
                              ("cache", cache, SnapshotCache)):
        if value is not None and not isinstance(value, kind):
            raise FanoutError(f"{name} must be a {kind.__name__} or None, got {shown(value)}")
    if progress is not None and not callable(progress):
        raise FanoutError(f"progress must be callable or None, got {shown(progress)}")


def _resume(ctx: Context, doc: list[int], cache: SnapshotCache | None, batch: Batch, progress: ProgressFn | None,
            after_chunk: Callable[[int, int], None] | None) -> int:
    """Make sequence 0 of ``ctx`` hold ``doc``: its longest prefix in ``cache`` restored, the rest prefilled.

    Returns the tokens restored (0: none). ``after_chunk`` sees the restored cells as one
    chunk ``[0, restored)`` before the prefilled ones; ``progress`` counts the whole document.
    """
    reused = cache.restore(doc, ctx, 0) if cache is not None else 0
    if reused:
        if after_chunk is not None:
            after_chunk(0, reused)
        if progress is not None:
            progress(reused, len(doc))
    if reused < len(doc):
        report = progress if progress is None or not reused else (
            lambda done, _n: progress(reused + done, len(doc)))
        prefill(ctx, doc[reused:], start_pos=reused, batch=batch, progress=report, logits_last=False,
                after_chunk=after_chunk)
    return reused


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
           flash_attn: str = "off", max_ctx: int | None = None, pool: ContextPool | None = None,
           host_pool: HostPool | None = None, progress: ProgressFn | None = None,
           fork: Fork = "during_prefill", cache: SnapshotCache | None = None) -> FanoutResult:
    """Prefill ``document`` once and generate every branch after it (see the module docstring).

    ``exact=True`` makes every branch token-identical to a from-scratch evaluation under
    the same settings, in either mode (module docstring): the branches then run one after
    another in the context that prefilled, each trimmed back to the document, and
    isolated mode takes no snapshot. The default ``exact=False`` lets a shared fan-out
    decode its branches together, which flips greedy tokens at near-ties, and an isolated
    one restore a snapshot per branch, exact only within the sliding window.
    ``FanoutResult.exact`` says which ran.

    ``fork`` (shared mode): when the branches get the document's cells, chunk by chunk
    during the prefill (default) or all at once after it; ``exact=True`` needs no fork.

    ``max_ctx`` caps the cells of a context this call creates: a shared one (document
    + every branch) or an isolated one (document + longest branch); default: the model's
    training context (more works but stretches RoPE past what the model was trained on).
    Every argument is checked first: a refusal is a :class:`FanoutError`.
    ``pool`` lets repeated fan-outs reuse contexts: in isolated mode its sequences need
    room for document + longest branch; in shared mode it must be unified with room for
    every branch (:func:`shared_params`). Budgets are checked before any context or
    buffer is allocated; ``n_batch``, ``n_threads`` and ``flash_attn`` apply only to
    contexts created without a pool (a pool's contexts keep the pool's parameters).
    ``cache``: restore the document's longest cached prefix and put the document's state
    there (module docstring); the cache owns what is put into it.
    """
    t0 = time.perf_counter()
    _check_options(mode, fork, exact, n_batch, n_threads, flash_attn, max_ctx, pool, host_pool, progress, cache)
    items = _branches(branches)
    doc = prompt_tokens(model, document, "the shared document", add_special=True, error=FanoutError)
    budgets = [branch_budget(model, b) for b in items]
    prompts = [tokens for tokens, _ in budgets]
    needs = [need for _, need in budgets]
    shared_cells = len(doc) + (max(needs) if exact else sum(needs))
    limit, limit_name = (max_ctx, "max_ctx") if max_ctx is not None else (
        model.n_ctx_train, "the model's training context (n_ctx_train; raise it with max_ctx)")
    chosen, reason = choose_mode(mode, len(items), shared_cells, limit, limit_name, pool)
    created = pool.created if pool is not None else 0

    if chosen == "shared":
        params = pool.params if pool is not None else shared_params(
            shared_cells, len(items), n_batch=n_batch, n_threads=n_threads, flash_attn=flash_attn)
        with _context(pool, params, model) as ctx, Batch(max(ctx.n_batch, len(items))) as batch:
            fork_s = 0.0

            def share(p0: int, p1: int) -> None:
                nonlocal fork_s
                t = time.perf_counter()
                for seq in range(1, len(items)):
                    ctx.seq_cp(0, seq, p0, p1)
                fork_s += time.perf_counter() - t

            forks = len(items) > 1 and not exact
            during = fork == "during_prefill" and forks
            t_pre = time.perf_counter()
            reused = _resume(ctx, doc, cache, batch, progress, share if during else None)
            t_doc = time.perf_counter()
            if cache is not None and reused < len(doc):
                cache.put(doc, Snapshot.capture(ctx, 0, pool=host_pool, tokens=doc))
            t_prefilled = time.perf_counter()
            if forks and not during:
                share(-1, -1)
            seqs = [0] * len(items) if exact else list(range(len(items)))
            results = run_branches(ctx, items, seqs, len(doc), exact=exact, t_start=t_prefilled,
                                   prompts=prompts, batch=batch)
        made = pool.created - created if pool is not None else 1
        return FanoutResult("shared", reason, exact, len(doc), (t_doc - t_pre) * 1e3, fork_s * 1e3,
                            results, (time.perf_counter() - t0) * 1e3, made, fork_overlapped=during,
                            reused_tokens=reused, cache_ms=(t_prefilled - t_doc) * 1e3)

    need = len(doc) + max(needs)
    own_pool = pool is None
    if pool is None and need > limit:
        raise FanoutError(f"isolated mode needs {need} cells for document ({len(doc)}) + longest branch "
                          f"({max(needs)}) in one context; {limit_name} allows {limit}")
    if pool is None:
        pool = ContextPool(model, isolated_params(need, n_batch=n_batch, n_threads=n_threads, flash_attn=flash_attn),
                           max_idle=1)
    elif pool.params.n_ctx // (1 if pool.params.kv_unified else pool.params.n_seq_max) < need:
        raise FanoutError(f"the context pool's sequences have {pool.params.n_ctx} cells; document ({len(doc)}) + "
                          f"longest branch ({max(needs)}) needs {need}")
    snapshot: Snapshot | None = None
    caching = False  # whether the document's snapshot goes into the cache at the end
    try:
        with Batch(max(pool.params.n_batch, 1)) as batch:
            with pool.lease() as ctx:
                t_pre = time.perf_counter()
                reused = _resume(ctx, doc, cache, batch, progress, None)
                t_fork = time.perf_counter()
                here = len(items) if exact else 1  # branches that continue in this context, one after another
                caching = cache is not None and reused < len(doc)
                if here < len(items) or caching:  # the other branches restore this, the cache keeps it
                    snapshot = Snapshot.capture(ctx, 0, pool=host_pool, tokens=doc)
                t_captured = time.perf_counter()
                results = run_branches(ctx, items[:here], [0] * here, len(doc), exact=True, t_start=t_captured,
                                       prompts=prompts[:here], batch=batch)
            if snapshot is not None and here < len(items):
                results += [run_isolated(snapshot, b, pool, prompt=prompt, batch=batch)
                            for b, prompt in zip(items[1:], prompts[1:])]
    finally:
        if snapshot is not None:
            if caching and cache is not None:
                cache.put(doc, snapshot)
            else:
                snapshot.release()
        made = pool.created - created
        if own_pool:
            pool.close()
    capture_ms = (t_captured - t_fork) * 1e3
    return FanoutResult("isolated", reason, exact, len(doc), (t_fork - t_pre) * 1e3,
                        capture_ms if here < len(items) else 0.0, results, (time.perf_counter() - t0) * 1e3, made,
                        reused_tokens=reused, cache_ms=0.0 if here < len(items) else capture_ms)
