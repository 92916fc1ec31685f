"""A DAG of agents over shared documents: prefill once, branches start at their watermark.

Three kinds of node:

- a **document** is prefilled once; at every watermark some branch asked for (and at
  its end) its state is captured into a host :class:`kvrt.state.snapshot.Snapshot`;
- a **branch** restores the snapshot of the first ``need_tokens`` document tokens
  (default: all of them) into a pooled context and generates - it starts as soon as
  the prefill has committed those tokens, at any K, because the prefill is cut into
  segments that end exactly at every watermark (SwarmKV only handled multiples of its
  128-token chunk);
- a **function** node receives its dependencies' outputs and returns its own.

Before anything is allocated, :meth:`Pipeline.run` checks names, dependencies, cycles
(naming the edge that closes one) and every branch's context budget (with every
number). A failing node fails its dependents at once, with the cause chained; nodes
that do not depend on it finish normally. Branches run in isolated mode (own context
each), which is what lets them start while the prefill is still running.

Exactness: a branch at watermark K continues a restored snapshot, so it is what
:mod:`kvrt.branching.branches` says of isolated mode: token-identical (greedy) to a fresh
llama.cpp context that decodes the document's segments as the prefill cut them (at every
watermark up to K, each in ``n_batch`` chunks), then the prompt, then each generated
token, with the same settings and ``flash_attn="off"`` (the default), while K + the
branch fit the model's sliding window; past it, equal up to the first near-tie.

Cache: given a :class:`kvrt.state.snapshot_cache.SnapshotCache` (``cache=``, shared with
fan-outs and other pipelines), each segment of a document's prefill first restores the
longest cached prefix of the document up to its watermark, if longer than what the
context holds, and prefills only the rest (``PipelineResult.reused_tokens``); when the
run ends, every watermark's snapshot and every document's is put into the cache. A
restored prefix is its cached state bit for bit, so the reference above then decodes
it as the run that cached it cut it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvrt.branching.branch import Branch, FanoutError, branch_budget
from kvrt.branching.pipeline_nodes import (
    BranchNode,
    BudgetError,
    CycleError,
    DependencyFailed,
    DocumentNode,
    FunctionNode,
    Node,
    NodeFailed,
    PipelineError,
    PipelineProgress,
    PipelineResult,
)
from kvrt.branching.runner import run_isolated
from kvrt.checks import INT32_MAX, check_int, shown
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, prefill
from kvrt.engine.model import Model
from kvrt.engine.prompt import prompt_tokens
from kvrt.state.contextpool import ContextPool
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot
from kvrt.state.snapshot_cache import SnapshotCache

__all__ = ["BudgetError", "CycleError", "DependencyFailed", "NodeFailed", "Pipeline", "PipelineError",
           "PipelineProgress", "PipelineResult"]


class Pipeline:
    """Named documents, branches and functions with dependencies (see the module docstring).

    ``n_ctx`` is the size of every branch's context (the budget each branch is checked
    against); ``max_workers`` bounds how many nodes run at once; ``flash_attn`` is passed
    to every context (see :class:`kvrt.engine.context.ContextParams`; ``"off"``, the
    default, keeps branches token-identical to a from-scratch evaluation); ``cache`` resumes
    documents from, and leaves their watermarks' snapshots in, a snapshot cache (module docstring).
    """

    def __init__(self, model: Model, *, n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 max_workers: int = 4, host_pool: HostPool | None = None, flash_attn: str = "off",
                 cache: SnapshotCache | None = None) -> None:
        check_int(n_batch, "n_batch", low=1, high=INT32_MAX, error=PipelineError)
        check_int(max_workers, "max_workers", low=1, high=1024, error=PipelineError)
        if host_pool is not None and not isinstance(host_pool, HostPool):
            raise PipelineError(f"host_pool must be a HostPool or None, got {shown(host_pool)}")
        if cache is not None and not isinstance(cache, SnapshotCache):
            raise PipelineError(f"cache must be a SnapshotCache or None, got {shown(cache)}")
        self.model = model
        self.params = ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512), n_threads=n_threads,
                                    flash_attn=flash_attn)
        self.max_workers = max_workers
        self.host_pool = host_pool
        self.cache = cache
        self._nodes: dict[str, Node] = {}

    # -- building -----------------------------------------------------------------------
    def _check_name(self, name: object) -> str:
        """A new node's name: a non-empty string not taken yet."""
        if not isinstance(name, str) or not name:
            raise PipelineError(f"a pipeline node needs a non-empty name (str), got {shown(name)}")
        if name in self._nodes:
            raise PipelineError(f"a node named {name!r} already exists")
        return name

    def document(self, name: str, source: str | Sequence[int]) -> None:
        """A shared document (text, tokenized with BOS, or token ids) prefilled once; checked and tokenized now."""
        self._check_name(name)
        tokens = prompt_tokens(self.model, source, f"document {name!r}", add_special=True, error=PipelineError)
        self._nodes[name] = DocumentNode(name, tokens)

    def branch(self, name: str, prompt: str, *, after: str, params: GenerationParams | None = None,
               need_tokens: int | None = None) -> None:
        """A branch continuing document ``after`` (its first ``need_tokens`` tokens, default all)."""
        self._check_name(name)
        if need_tokens is not None:
            check_int(need_tokens, f"branch {name!r}: need_tokens", low=1, high=INT32_MAX, error=PipelineError)
        try:
            branch = Branch(prompt, GenerationParams() if params is None else params, name)
        except FanoutError as exc:
            raise PipelineError(str(exc)) from exc
        self._nodes[name] = BranchNode(name, branch, after, need_tokens)

    def node(self, name: str, fn: Callable[[dict[str, Any]], Any], *, deps: Sequence[str] = ()) -> None:
        """A function of its dependencies' outputs (``{dep_name: output}``)."""
        self._check_name(name)
        if not callable(fn):
            raise PipelineError(f"node {name!r}: fn must be callable, got {shown(fn)}")
        if isinstance(deps, str) or not isinstance(deps, Sequence) or not all(isinstance(d, str) for d in deps):
            raise PipelineError(f"node {name!r}: deps must be a list of node names, got {shown(deps)}")
        self._nodes[name] = FunctionNode(name, fn, tuple(deps))

    # -- validation (nothing allocated) -----------------------------------------------
    def _check_graph(self) -> None:
        for node in self._nodes.values():
            for dep in node.deps:
                if dep not in self._nodes:
                    raise PipelineError(f"node {node.name!r} depends on {dep!r}, which does not exist")
            if isinstance(node, BranchNode) and not isinstance(self._nodes[node.after], DocumentNode):
                raise PipelineError(f"branch {node.name!r} must follow a document; {node.after!r} is not one")
        # depth-first with an explicit stack (a chain of thousands of nodes must not hit the recursion limit)
        white, grey, black = 0, 1, 2
        colour = dict.fromkeys(self._nodes, white)
        for root in self._nodes:
            if colour[root] != white:
                continue
            colour[root] = grey
            path: list[str] = [root]
            stack = [iter(self._nodes[root].deps)]
            while stack:
                name = path[-1]
                child = next(stack[-1], None)
                if child is None:
                    stack.pop()
                    path.pop()
                    colour[name] = black
                elif colour[child] == grey:
                    cycle = path[path.index(child):] + [child]
                    raise CycleError((name, child), cycle)
                elif colour[child] == white:
                    colour[child] = grey
                    path.append(child)
                    stack.append(iter(self._nodes[child].deps))

    def _plan(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Document tokens and each branch's watermark, after checking every budget."""
        docs: dict[str, list[int]] = {}
        for node in self._nodes.values():
            if isinstance(node, DocumentNode):
                if len(node.tokens) > self.params.n_ctx:
                    raise BudgetError(f"document {node.name!r} has {len(node.tokens)} tokens > "
                                      f"n_ctx={self.params.n_ctx}")
                docs[node.name] = node.tokens
        marks: dict[str, int] = {}
        for node in self._nodes.values():
            if not isinstance(node, BranchNode):
                continue
            doc_len = len(docs[node.after])
            mark = node.need_tokens or doc_len
            if mark > doc_len:
                raise BudgetError(f"branch {node.name!r} needs the first {mark} tokens of {node.after!r}, "
                                  f"which has only {doc_len}")
            prompt, need = branch_budget(self.model, node.branch)
            total = mark + need
            if total > self.params.n_ctx:
                raise BudgetError(
                    f"branch {node.name!r} does not fit its context: document prefix {mark} + prompt {len(prompt)} "
                    f"+ max_tokens {node.branch.params.max_tokens} = {total} tokens > n_ctx={self.params.n_ctx}")
            marks[node.name] = mark
        return docs, marks

    # -- running --------------------------------------------------------------------------
    def run(self, *, progress: PipelineProgress | None = None, raise_errors: bool = True) -> PipelineResult:
        """Run every node; raises :class:`NodeFailed` (with the partial result) if any failed."""
        self._check_graph()
        docs, marks = self._plan()
        result = _Run(self, docs, marks, progress).execute()
        if raise_errors and result.errors:
            raise NodeFailed(result)
        return result


class _Run:
    """One execution: a scheduler on the calling thread, nodes on worker threads.

    Workers report through one queue: ``("mark", doc, K)`` when a watermark snapshot is
    ready and ``("done", name, output)`` / ``("fail", name, exc)`` exactly once per node,
    so the scheduler always learns how every node ended and never waits forever.
    """

    def __init__(self, pipeline: Pipeline, docs: dict[str, list[int]], marks: dict[str, int],
                 progress: PipelineProgress | None) -> None:
        self.p = pipeline
        self.docs = docs
        self.marks = marks
        self.progress = progress
        self.events: queue.Queue[tuple[str, str, Any]] = queue.Queue()
        self.snapshots: dict[tuple[str, int], Snapshot] = {}
        self.result = PipelineResult()
        self.state: dict[str, str] = dict.fromkeys(pipeline._nodes, "waiting")
        self.open = len(self.state)  # nodes not done or failed yet
        self.dependents: dict[str, list[str]] = {}  # node -> the nodes that depend on it
        for node in pipeline._nodes.values():
            for dep in node.deps:
                self.dependents.setdefault(dep, []).append(node.name)
        self.t0 = 0.0

    def _ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def execute(self) -> PipelineResult:
        self.t0 = time.perf_counter()
        pool = ContextPool(self.p.model, self.p.params, max_idle=self.p.max_workers)
        try:
            with ThreadPoolExecutor(self.p.max_workers, thread_name_prefix="kvrt-pipeline") as executor:
                self._schedule(executor, pool)
                while self.open:
                    kind, name, payload = self.events.get()
                    if kind == "mark":  # branches of that document may start
                        self._schedule(executor, pool, self.dependents.get(name, ()))
                        continue
                    self.result.timings_ms.setdefault(name, {})["end_ms"] = self._ms()
                    self.open -= 1
                    if kind == "done":
                        self.state[name] = "done"
                        self.result.outputs[name] = payload
                    else:
                        self.state[name] = "failed"
                        self.result.errors[name] = payload
                        self._fail_dependents(name, payload)
                    self._schedule(executor, pool, self.dependents.get(name, ()))
        finally:
            cache = self.p.cache
            for (doc, mark), snapshot in self.snapshots.items():
                if cache is None:
                    snapshot.release()
                else:
                    cache.put(self.docs[doc][:mark], snapshot)
            pool.close()
        self.result.total_ms = self._ms()
        return self.result

    def _ready(self, node: Node) -> bool:
        if isinstance(node, BranchNode):
            return (node.after, self.marks[node.name]) in self.snapshots
        return all(self.state[d] == "done" for d in node.deps)

    def _schedule(self, executor: ThreadPoolExecutor, pool: ContextPool,
                  candidates: Iterable[str] | None = None) -> None:
        """Start the waiting nodes among ``candidates`` (default: all) that are ready."""
        for name in self.p._nodes if candidates is None else candidates:
            node = self.p._nodes[name]
            if self.state[name] == "waiting" and self._ready(node):
                self.state[name] = "running"
                self.result.timings_ms[name] = {"start_ms": self._ms()}
                executor.submit(self._guarded, node, pool)

    def _fail_dependents(self, failed: str, cause: BaseException) -> None:
        """Fail every waiting node that depends on ``failed``, directly or not, at once (no recursion)."""
        todo = [(failed, cause)]
        while todo:
            failed, cause = todo.pop()
            for name in self.dependents.get(failed, ()):
                if self.state[name] == "waiting":
                    error = DependencyFailed(f"{name!r} did not run: {failed!r} failed: "
                                             f"{type(cause).__name__}: {cause}")
                    error.__cause__ = cause
                    self.state[name] = "failed"
                    self.open -= 1
                    self.result.errors[name] = error
                    todo.append((name, error))

    def _guarded(self, node: Node, pool: ContextPool) -> None:
        try:
            output = self._execute(node, pool)
        except BaseException as exc:  # reported to the scheduler, never swallowed
            self.events.put(("fail", node.name, exc))
        else:
            self.events.put(("done", node.name, output))

    def _execute(self, node: Node, pool: ContextPool) -> Any:
        if isinstance(node, DocumentNode):
            return self._prefill(node, pool)
        if isinstance(node, BranchNode):
            snapshot = self.snapshots[(node.after, self.marks[node.name])]
            branch = run_isolated(snapshot, node.branch, pool)
            self.result.timings_ms[node.name].update(activation_ms=branch.activation_ms, restore_ms=branch.restore_ms,
                                                     decode_ms=branch.total_ms - branch.activation_ms)
            return branch.completion
        return node.fn({d: self.result.outputs[d] for d in node.deps})

    def _prefill(self, node: DocumentNode, pool: ContextPool) -> int:
        tokens = self.docs[node.name]
        total = len(tokens)
        wanted = sorted({m for b, m in self.marks.items() if self.p._nodes[b].deps == (node.name,)} | {total})
        timings = self.result.timings_ms[node.name]
        watermark_ms: dict[int, float] = {}
        t_start = time.perf_counter()
        prefilled = 0
        cache = self.p.cache
        with pool.lease() as ctx:
            begin = 0
            for mark in wanted:
                restored = 0 if cache is None else cache.restore(tokens[:mark], ctx, 0, longer_than=begin)
                begin = max(begin, restored)

                def report(done: int, _n: int, offset: int = begin) -> None:
                    if self.progress is not None:
                        self.progress(node.name, offset + done, total)

                if restored:
                    report(0, 0)
                if begin < mark:
                    prefill(ctx, tokens[begin:mark], start_pos=begin, progress=report, logits_last=False)
                    prefilled += mark - begin
                self.snapshots[(node.name, mark)] = Snapshot.capture(ctx, 0, pool=self.p.host_pool,
                                                                     tokens=tokens[:mark])
                watermark_ms[mark] = (time.perf_counter() - t_start) * 1e3
                self.events.put(("mark", node.name, mark))
                begin = mark
        timings.update(prefill_ms=(time.perf_counter() - t_start) * 1e3, watermark_ms=watermark_ms)
        self.result.reused_tokens[node.name] = total - prefilled
        return total
