"""The arms of the fan-out benchmark: N branches after one document, each arm its own way.

Every arm gets the same document ids, the same branch prompts and greedy decoding, and
everything an arm keeps between runs (pooled contexts, the pinned snapshot buffer, the
peer's ``Llama``) is made before the clock by :func:`make_setup` and one untimed warm-up
run. On the clock, per arm:

``naive``
    the seed's baseline, kept as a labelled second column: per branch a fresh context
    is created, prefills the whole document, decodes through llama.cpp's sampler chain
    and is freed (:func:`run_baseline`).
``baseline``
    the strongest honest way without kvrt, and the reference for every ratio: per
    branch, one pooled, warmed context (the isolated arm's pool) emptied between
    branches prefills the whole document and decodes the branch with kvrt's own greedy
    argmax; branches one after another.
``peer-ram`` / ``peer-disk``
    llama-cpp-python's ``Llama`` with ``LlamaRAMCache`` / ``LlamaDiskCache``
    (:mod:`kvrt_bench._peer`), emptied before each run: ``create_completion`` of
    document + prompt per branch, in order (the later branches reuse the live
    context's document prefix; every completion saves its state into the cache).
``isolated`` / ``shared``
    :func:`kvrt.branching.branches.fanout` on the pools.
``isolated-cold``
    kvrt's isolated mode without pools: every context it uses is created on the clock
    (branch 2's activation then covers what SwarmKV's 83 ms did: context allocation,
    restore, prompt and first token).
``ideal``
    the yardstick, measured in the same round: one prefill of the document, then one
    decode of all branches from a free fork, each phase ending on a synchronisation.
    Strategy *batched*: in the shared arm's pooled context, the branches get the
    document's cells by ``seq_cp`` off the clock and decode in one batch per step.
    With ``ideal_decode="best"`` also strategy *one sequence*: in the isolated arm's
    one-sequence context, the branches decode one after another, each trimmed off
    again (``seq_rm`` back to the document) before the next. The ideal is then the
    faster prefill plus the faster decode of the two: on a CPU the unified
    multi-sequence context prefilled measurably slower than a one-sequence one, and a
    tiny model's batched decode was slower than one branch at a time, so neither
    strategy alone is a floor there. ``"batched"`` (a GPU, where the two prefills
    measured equal and batching wins by far) runs the first strategy only.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvrt.branching.baseline import run_baseline
from kvrt.branching.branches import (
    Branch,
    BranchResult,
    FanoutResult,
    branch_budget,
    fanout,
    isolated_params,
    run_branches,
    shared_params,
)
from kvrt.engine.batch import Batch
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, prefill
from kvrt.engine.model import Model
from kvrt.state.contextpool import ContextPool
from kvrt_bench._peer import LlamaPeer

ARMS = ("naive", "baseline", "peer-ram", "peer-disk", "isolated", "isolated-cold", "shared", "ideal")
REFERENCE = "baseline"
KVRT_ARMS = ("isolated", "isolated-cold", "shared")
PEER_ARMS = {"peer-ram": "ram", "peer-disk": "disk"}
PEER_KEPT_STATES = 2  # the peer's RAM cache holds this many whole states (each also copies n_batch x n_vocab logits)
SENTENCE = "The quick brown fox jumps over the lazy dog. "
QUESTIONS = (" Question: which animal jumps? Answer:", " Question: what is the dog like? Answer:")


def fox_document(model: Model, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` token ids: BOS (if the model adds one) + the fox sentence repeated."""
    sentence = model.tokenize(SENTENCE, add_special=False)
    head = model.tokenize("", add_special=True)
    repeats = -(-max(n_tokens - len(head), 1) // len(sentence))
    return (head + sentence * repeats)[:n_tokens]


@dataclass
class ArmRun:
    """One timed fan-out of one arm.

    ``activation_ms`` is branch 2's work before its first token (branch 1's when N = 1),
    counted from when that branch could start: its own start for the sequential arms,
    the end of the shared prefill for kvrt and the ideal.
    """

    total_ms: float
    texts: list[str]
    activation_ms: float
    prefill_ms: float = 0.0
    fork_ms: float = 0.0
    restore_ms: float = 0.0  # mean over the branches that restored a snapshot
    contexts_created: int = 0
    result: FanoutResult | None = None


@dataclass
class Setup:
    """What every arm of one document length shares, made before any clock starts."""

    model: Model
    doc: list[int]
    branches: list[Branch]
    prompts: list[list[int]]
    pools: dict[str, ContextPool]
    naive_params: ContextParams
    fork: str
    ideal_decode: str = "best"
    peer: LlamaPeer | None = None
    peer_capacity: int = 0
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pool in self.pools.values():
            pool.close()
        if self.peer is not None:
            self.peer.close()


def branches_for(n: int, max_tokens: int) -> list[Branch]:
    """``n`` greedy branches alternating the two questions."""
    return [Branch(QUESTIONS[i % 2], GenerationParams(max_tokens=max_tokens), f"agent{i + 1}") for i in range(n)]


def make_setup(model: Model, doc_tokens: int, n_max: int, arms: list[str], args: argparse.Namespace) -> Setup:
    """Pools for kvrt and the warm baseline, the naive baseline's context shape and (if asked) the peer."""
    doc = fox_document(model, doc_tokens)
    branches = branches_for(n_max, args.max_tokens)
    budgets = [branch_budget(model, b) for b in branches]
    need = max(cells for _, cells in budgets)
    iso = replace(isolated_params(len(doc) + need, n_batch=args.n_batch, n_threads=args.threads),
                  flash_attn=args.flash_attn)
    shared = replace(shared_params(len(doc) + need * n_max, n_max, n_batch=args.n_batch, n_threads=args.threads),
                     flash_attn=args.flash_attn)
    pools = {"isolated": ContextPool(model, iso, max_idle=1), "shared": ContextPool(model, shared, max_idle=1),
             "isolated-cold": ContextPool(model, iso, max_idle=0)}  # max_idle 0: every lease creates a context
    setup = Setup(model, doc, branches, [tokens for tokens, _ in budgets], pools, iso, args.fork, args.ideal_decode)
    if any(arm in PEER_ARMS for arm in arms):
        setup.peer = LlamaPeer(model.path, n_ctx=iso.n_ctx, n_batch=args.n_batch, n_threads=args.threads,
                               n_gpu_layers=args.n_gpu_layers, flash_attn=args.flash_attn == "on")
    return setup


def _warm_baseline(setup: Setup, n: int) -> ArmRun:
    """The reference: per branch a pooled context (emptied by the pool) prefills the document, then the branch."""
    t0 = time.perf_counter()
    texts, activations, prefills = [], [], []
    pool = setup.pools["isolated"]
    with Batch(max(pool.params.n_batch, 1)) as batch:
        for branch, prompt in zip(setup.branches[:n], setup.prompts[:n]):
            t_branch = time.perf_counter()
            with pool.lease() as ctx:
                prefill(ctx, setup.doc, batch=batch, logits_last=False)
                prefills.append((time.perf_counter() - t_branch) * 1e3)
                done = run_branches(ctx, [branch], [0], len(setup.doc), exact=True, t_start=t_branch,
                                    prompts=[prompt], batch=batch)[0]
            texts.append(done.text)
            activations.append(done.activation_ms)
    return ArmRun((time.perf_counter() - t0) * 1e3, texts, activations[min(1, n - 1)], sum(prefills))


def _naive(setup: Setup, n: int) -> ArmRun:
    base = run_baseline(setup.model, setup.doc, setup.branches[:n], setup.naive_params)
    return ArmRun(base.end_to_end_ms, base.texts, base.activation_ms[min(1, n - 1)], sum(base.prefill_ms),
                  contexts_created=n)


def _kvrt(mode: str, pool_name: str) -> Callable[[Setup, int], ArmRun]:
    def run(setup: Setup, n: int) -> ArmRun:
        pool = setup.pools[pool_name]
        result = fanout(setup.model, setup.doc, setup.branches[:n], mode=mode, pool=pool,
                        max_ctx=setup.pools["shared"].params.n_ctx, fork=setup.fork)
        later = result.branches[1:] or result.branches
        return ArmRun(result.total_ms, result.texts, result.branches[min(1, n - 1)].activation_ms,
                      result.prefill_ms, result.fork_ms, sum(b.restore_ms for b in later) / len(later),
                      result.contexts_created, result)
    run.__name__ = f"run_{mode}_{pool_name}"
    return run


IDEAL_DECODES = ("best", "batched")


def _batched_strategy(setup: Setup, n: int) -> tuple[float, float, list[BranchResult]]:
    """(prefill ms, decode ms, results): the shared context, a free fork, one batch per step."""
    with setup.pools["shared"].lease() as ctx, Batch(max(ctx.n_batch, n)) as batch:
        t0 = time.perf_counter()
        prefill(ctx, setup.doc, batch=batch, logits_last=False)
        ctx.synchronize()
        prefill_ms = (time.perf_counter() - t0) * 1e3
        for seq in range(1, n):
            ctx.seq_cp(0, seq)
        ctx.synchronize()
        t1 = time.perf_counter()
        results = run_branches(ctx, setup.branches[:n], range(n), len(setup.doc), exact=False, t_start=t1,
                               prompts=setup.prompts[:n], batch=batch)
        return prefill_ms, (time.perf_counter() - t1) * 1e3, results


def _one_sequence_strategy(setup: Setup, n: int) -> tuple[float, float, list[BranchResult]]:
    """(prefill ms, decode ms, results): a one-sequence context, the branches one after another, each trimmed
    back to the document before the next."""
    with setup.pools["isolated"].lease() as ctx, Batch(max(ctx.n_batch, 1)) as batch:
        t0 = time.perf_counter()
        prefill(ctx, setup.doc, batch=batch, logits_last=False)
        ctx.synchronize()
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        results = []
        for branch, prompt in zip(setup.branches[:n], setup.prompts[:n]):
            results += run_branches(ctx, [branch], [0], len(setup.doc), exact=True, t_start=t1, prompts=[prompt],
                                    batch=batch)
            ctx.seq_rm(0, len(setup.doc), -1)
        return prefill_ms, (time.perf_counter() - t1) * 1e3, results


def _ideal(setup: Setup, n: int) -> ArmRun:
    """The faster prefill plus the faster decode of the strategies run (see the module docstring)."""
    prefill_ms, decode_ms, results = _batched_strategy(setup, n)
    if setup.ideal_decode == "best":
        other_prefill, other_decode, other = _one_sequence_strategy(setup, n)
        prefill_ms = min(prefill_ms, other_prefill)
        if other_decode < decode_ms:
            decode_ms, results = other_decode, other
    return ArmRun(prefill_ms + decode_ms, [r.text for r in results], results[min(1, n - 1)].activation_ms,
                  prefill_ms)


def _peer(kind: str) -> Callable[[Setup, int], ArmRun]:
    def run(setup: Setup, n: int) -> ArmRun:
        peer = setup.peer
        assert peer is not None, "make_setup builds the peer when a peer arm is asked for"
        peer.empty_cache(kind, capacity_bytes=setup.peer_capacity or (2 << 30))  # off the clock
        t0 = time.perf_counter()
        done = [peer.complete(setup.doc + prompt, b.params.max_tokens)
                for b, prompt in zip(setup.branches[:n], setup.prompts[:n])]
        total = (time.perf_counter() - t0) * 1e3
        return ArmRun(total, [d.text for d in done], done[min(1, n - 1)].first_token_ms)
    run.__name__ = f"run_peer_{kind}"
    return run


RUNNERS: dict[str, Callable[[Setup, int], ArmRun]] = {
    "naive": _naive,
    "baseline": _warm_baseline,
    "peer-ram": _peer("ram"),
    "peer-disk": _peer("disk"),
    "isolated": _kvrt("isolated", "isolated"),
    "isolated-cold": _kvrt("isolated", "isolated-cold"),
    "shared": _kvrt("shared", "shared"),
    "ideal": _ideal,
}


def warm(setup: Setup, arms: list[str], n: int) -> None:
    """Untimed: every pool's contexts, the pinned snapshot buffer and one run of every arm at ``n`` branches.

    The peer's RAM cache is then sized to keep :data:`PEER_KEPT_STATES` whole states.
    """
    for pool in setup.pools.values():
        if pool.max_idle:
            pool.warm(1)
    for arm in arms:
        RUNNERS[arm](setup, n)
    if setup.peer is not None:
        setup.peer_capacity = PEER_KEPT_STATES * setup.peer.state_bytes()

