"""Agents time-sliced on one device: per-agent queues, a bounded set of live contexts, KV swap.

lmxd keeps one live context and swaps on every agent switch. kvrt keeps as many live
contexts as the ledger admits; only when an agent must run and its context does not fit
is the least-recently-used idle agent swapped out: its sequence state is captured into
the (pinned) host pool with :class:`kvrt.state.snapshot.Snapshot`, its context freed or,
when the incoming agent has the same model and size, handed over as it is (creating a
context costs tens of ms on a GPU, about as much as the restore). The state is
restored, bit for bit, the next time the agent runs.

Fairness: **least attained service by tokens** (start-time fair queueing at request
granularity). The next request comes from the backlogged agent that has been served the
fewest tokens (prompt + generated); an agent that was idle re-enters at the current
minimum, so idling banks no credit. Among equals, an agent whose context is live goes
first (a free hit instead of a swap), then the least recently run. Why this and not plain round-robin: an agent with
long requests cannot take more than its share of tokens, and an agent with short
requests is never stuck behind it; why requests are not cut into slices: a request
once started runs to completion, so time-slicing never forces a swap in the middle of a
generation, which on a full device would turn every slice into a swap-out/swap-in pair.
No agent starves: every service raises the served count of the agent that got it, so
any backlogged agent becomes the minimum after finitely many others' requests.

Every llama.cpp call happens on the scheduler's one worker thread (the device runs one
decode at a time anyway); other threads only enqueue and wait on futures.

With a ``state_dir`` (:mod:`kvrt.state.agentstore`) agents outlive the process: an agent's state
is saved when it is swapped out and, for every agent, when the scheduler closes; a new
scheduler on the same directory brings them back swapped out, and their next request
continues from the saved KV exactly as if the process had never stopped. A saved agent
that cannot be restored (damaged file, changed model, no room) is skipped and listed in
:attr:`Scheduler.state_problems`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvrt.engine.context import Context, ContextParams
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import KvrtError
from kvrt.serve.estimate import DeviceMeter, context_estimate
from kvrt.serve.ledger import LedgerDenied, Reservation, VramLedger
from kvrt.serve.registry import LoadedModel, ModelRegistry
from kvrt.state.agentstore import AgentRecord, AgentStore, StateFileError, StateProblem
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot

T = TypeVar("T")
log = logging.getLogger("kvrt.serve.scheduler")
AGENT_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-:@")
MAX_AGENT_ID = 64
HISTORY = 100_000  # request metrics kept per scheduler for percentiles


class SchedulerError(KvrtError):
    """A scheduler request was refused; ``code`` is its protocol error code."""

    code = "SCHEDULER"


class UnknownAgent(SchedulerError):
    code = "UNKNOWN_AGENT"


class AgentExists(SchedulerError):
    code = "AGENT_EXISTS"


class SchedulerClosed(SchedulerError):
    code = "SHUTTING_DOWN"


class InvalidArgument(SchedulerError):
    code = "BAD_ARGS"


def check_agent_id(agent_id: str) -> str:
    if not isinstance(agent_id, str) or not 0 < len(agent_id) <= MAX_AGENT_ID or not set(agent_id) <= AGENT_ID_CHARS:
        raise InvalidArgument(f"agent id must be 1..{MAX_AGENT_ID} characters of [A-Za-z0-9_.:@-], got {agent_id!r}")
    return agent_id


@dataclass(frozen=True)
class RequestMetrics:
    """What one request cost, by phase (milliseconds and bytes)."""

    agent_id: str
    queue_wait_ms: float
    swap_out_bytes: int
    swap_out_ms: float
    swap_in_bytes: int
    swap_in_ms: float
    context_ms: float
    decode_ms: float
    latency_ms: float
    prompt_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class DecodeResult:
    """A finished request: its text and what switching to its agent cost."""

    agent_id: str
    text: str
    tokens: list[int]
    finish_reason: str
    evicted: tuple[str, ...]
    restored: bool
    metrics: RequestMetrics


@dataclass
class _Request:
    prompt: str
    params: GenerationParams
    future: Future[DecodeResult]
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Agent:
    agent_id: str
    entry: LoadedModel
    n_ctx: int
    context_bytes: int
    queue: deque[_Request] = field(default_factory=deque)
    context: Context | None = None
    reservation: Reservation | None = None
    snapshot: Snapshot | None = None
    served_tokens: int = 0
    held_tokens: int = 0  # tokens of its document (updated on the worker; readable from any thread)
    last_used: int = 0
    requests: int = 0
    persisted: bool = False  # the state dir holds its current state

    @property
    def state(self) -> str:
        return "active" if self.context is not None else "swapped" if self.snapshot is not None else "cold"


@dataclass
class _Switch:
    """What making an agent runnable cost (filled while activating it)."""

    evicted: list[str] = field(default_factory=list)
    restored: bool = False
    out_bytes: int = 0
    out_ms: float = 0.0
    in_bytes: int = 0
    in_ms: float = 0.0
    context_ms: float = 0.0


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p95/p99 (linear interpolation), or NaN-free zeros for no data."""
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


class Scheduler:
    """Register agents on models, queue their requests, run them fairly on one device.

    ``ledger`` admits weights and contexts; ``registry`` shares models (one is made on
    ``ledger`` when not given). ``n_threads`` is passed to every context; ``pool`` is
    the host pool that swapped-out states live in. ``state_dir`` keeps agents across
    restarts: the agents saved there are restored before the constructor returns.
    """

    def __init__(self, ledger: VramLedger, registry: ModelRegistry | None = None, *, n_ubatch: int = 512,
                 n_threads: int | None = None, pool: HostPool | None = None,
                 state_dir: str | os.PathLike[str] | None = None) -> None:
        self.ledger = ledger
        self.registry = registry or ModelRegistry(ledger)
        self._owns_registry = registry is None
        self.n_ubatch = n_ubatch
        self.n_threads = n_threads
        self.pool = pool
        self._agents: dict[str, _Agent] = {}
        self._control: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._cond = threading.Condition()
        self._clock = itertools.count(1)
        self._history: deque[RequestMetrics] = deque(maxlen=HISTORY)
        self._closing = False
        self._busy = False  # the worker is running a job (set and cleared under the lock)
        self.store = AgentStore(state_dir) if state_dir is not None else None
        self.state_problems: list[StateProblem] = []
        self.state_restored = 0
        self._worker = threading.Thread(target=self._run, name="kvrt-scheduler", daemon=True)
        self._worker.start()
        if self.store is not None:
            self._call(self._restore_all)

    # -- public API (any thread) --------------------------------------------------------
    def register(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int = 4096) -> dict[str, Any]:
        """Admit an agent on ``model_path`` with a context of ``n_ctx`` cells.

        Refused with :class:`kvrt.serve.ledger.LedgerDenied` when the model's weights plus this
        one context cannot fit even with every other agent swapped out.
        """
        check_agent_id(agent_id)
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0:
            raise InvalidArgument(f"n_ctx must be a positive integer, got {n_ctx!r}")
        return self._call(lambda: self._register(agent_id, model_path, n_ctx))

    def unregister(self, agent_id: str) -> None:
        """Remove an agent: queued requests fail, its context, state and model reference go."""
        self._call(lambda: self._unregister(agent_id))

    def fork(self, source_id: str, agent_id: str) -> dict[str, Any]:
        """A new agent that starts from a copy of ``source_id``'s document (same model and size)."""
        check_agent_id(agent_id)
        return self._call(lambda: self._fork(source_id, agent_id))

    def submit(self, agent_id: str, prompt: str, n_tokens: int, *,
               sampling: SamplingParams | None = None) -> Future[DecodeResult]:
        """Queue ``prompt`` (appended to the agent's document) and ``n_tokens`` of generation."""
        params = GenerationParams(max_tokens=n_tokens, sampling=sampling or SamplingParams())
        request = _Request(prompt, params, Future())
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the scheduler is shutting down")
            agent = self._agents.get(agent_id)
            if agent is None:
                raise UnknownAgent(f"no agent {agent_id!r} is registered")
            if not agent.queue:
                backlogged = [a.served_tokens for a in self._agents.values() if a.queue]
                agent.served_tokens = max(agent.served_tokens, min(backlogged, default=agent.served_tokens))
            agent.queue.append(request)
            self._cond.notify()
        return request.future

    def decode(self, agent_id: str, prompt: str, n_tokens: int, *,
               sampling: SamplingParams | None = None) -> DecodeResult:
        return self.submit(agent_id, prompt, n_tokens, sampling=sampling).result()

    def agents(self) -> list[dict[str, Any]]:
        with self._cond:
            return [{"agent_id": a.agent_id, "model": a.entry.path.name, "n_ctx": a.n_ctx, "state": a.state,
                     "context_bytes": a.context_bytes, "queued": len(a.queue), "requests": a.requests,
                     "served_tokens": a.served_tokens, "held_tokens": a.held_tokens}
                    for a in self._agents.values()]

    def metrics(self, agent_id: str | None = None) -> dict[str, Any]:
        """Request count, tokens, swap totals and latency/queue-wait percentiles (ms)."""
        with self._cond:
            if agent_id is not None and agent_id not in self._agents:
                raise UnknownAgent(f"no agent {agent_id!r} is registered")
            rows = [m for m in self._history if agent_id is None or m.agent_id == agent_id]
        return {
            "requests": len(rows),
            "generated_tokens": sum(m.generated_tokens for m in rows),
            "swap_outs": sum(1 for m in rows if m.swap_out_bytes),
            "swap_ins": sum(1 for m in rows if m.swap_in_bytes),
            "swap_out_bytes": sum(m.swap_out_bytes for m in rows),
            "swap_in_bytes": sum(m.swap_in_bytes for m in rows),
            "latency_ms": percentiles([m.latency_ms for m in rows]),
            "queue_wait_ms": percentiles([m.queue_wait_ms for m in rows]),
            "swap_in_ms": percentiles([m.swap_in_ms for m in rows if m.swap_in_bytes]),
            "decode_ms": percentiles([m.decode_ms for m in rows]),
        }

    def history(self) -> list[RequestMetrics]:
        with self._cond:
            return list(self._history)

    def close(self, timeout: float | None = None) -> bool:
        """Fail queued requests, let the running one finish, save (with a state dir) and free every agent.

        Waits at most ``timeout`` seconds (None: as long as it takes) for the running
        request. Returns False when it was still running then: it is abandoned to the
        worker, and nothing it might touch (contexts, models, states) is freed or saved.
        """
        with self._cond:
            if self._closing:
                return not self._worker.is_alive()
            self._closing = True
            self._cond.notify_all()
        self._fail_queued()  # at once: the worker starts nothing new once closing is set
        with self._cond:
            finished = self._cond.wait_for(lambda: not self._busy, timeout)
        if not finished:
            log.warning("scheduler closed with a job still running after %s s: abandoned, its agents neither "
                        "saved nor freed", timeout)
            return False
        self._worker.join()  # idle and told to close: it returns at once
        for agent in self._agents.values():
            self._persist(agent)
        for agent in list(self._agents.values()):
            self._teardown(agent, SchedulerClosed("the scheduler shut down before this request ran"))
        self._agents.clear()
        if self.store is not None:
            self.store.close()
        if self._owns_registry:
            self.registry.close()
        return True

    def _fail_queued(self) -> None:
        """Refuse every call and request not yet started (safe while the worker runs: it pops under the lock)."""
        with self._cond:
            while self._control:
                self._control.popleft()[1].set_exception(
                    SchedulerClosed("the scheduler shut down before this call ran"))
            for agent in self._agents.values():
                while agent.queue:
                    agent.queue.popleft().future.set_exception(
                        SchedulerClosed("the scheduler shut down before this request ran"))

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the worker -----------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker (every llama.cpp call happens there) and wait for it."""
        future: Future[T] = Future()
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the scheduler is shutting down")
            self._control.append((fn, future))
            self._cond.notify()
        return future.result()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._control and not any(a.queue for a in self._agents.values()):
                    self._cond.wait()
                if self._closing:
                    return
                if self._control:
                    fn, future = self._control.popleft()
                    job: Callable[[], None] = functools.partial(_settle, future, fn)
                else:
                    agent = min((a for a in self._agents.values() if a.queue),
                                key=lambda a: (a.served_tokens, a.context is None, a.last_used))
                    request = agent.queue.popleft()
                    job = functools.partial(self._serve, agent, request)
                self._busy = True
            try:
                job()
            except BaseException:  # a bug in one job must not stop every agent's queue
                log.exception("scheduler job failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _serve(self, agent: _Agent, request: _Request) -> None:
        if not request.future.set_running_or_notify_cancel():
            return
        started = time.perf_counter()
        switch = _Switch()
        try:
            self._activate(agent, switch)
            assert agent.context is not None
            completion = generate(agent.context, request.prompt, request.params)
        except BaseException as exc:
            request.future.set_exception(exc)
            return
        finally:
            agent.last_used = next(self._clock)
            if agent.context is not None:
                agent.held_tokens = agent.context.seq_len(0)
        done = time.perf_counter()
        metrics = RequestMetrics(
            agent_id=agent.agent_id, queue_wait_ms=(started - request.submitted) * 1e3,
            swap_out_bytes=switch.out_bytes, swap_out_ms=switch.out_ms, swap_in_bytes=switch.in_bytes,
            swap_in_ms=switch.in_ms, context_ms=switch.context_ms,
            decode_ms=completion.timings_ms.get("prefill_ms", 0.0) + completion.timings_ms.get("decode_ms", 0.0),
            latency_ms=(done - request.submitted) * 1e3, prompt_tokens=completion.prompt_tokens,
            generated_tokens=len(completion.tokens))
        with self._cond:
            agent.served_tokens += completion.prompt_tokens + len(completion.tokens)
            agent.requests += 1
            self._history.append(metrics)
        request.future.set_result(DecodeResult(agent.agent_id, completion.text, completion.tokens,
                                               completion.finish_reason, tuple(switch.evicted), switch.restored,
                                               metrics))

    # -- activation and swap ----------------------------------------------------------------
    def _activate(self, agent: _Agent, switch: _Switch) -> None:
        """Give ``agent`` a live context holding its document, evicting LRU agents as needed."""
        if agent.context is not None:
            return
        agent.persisted = False  # it is about to change: the saved state stops being current
        owner = f"agent:{agent.agent_id}"
        while agent.context is None:
            try:
                reservation = self.ledger.try_reserve(agent.context_bytes, owner)
            except LedgerDenied:
                victim = self._lru_victim(agent)
                if victim is None:
                    raise
                self._swap_out(victim, switch)
                if self._compatible(victim, agent):  # hand the live context over instead of re-creating it
                    agent.context, agent.reservation = victim.context, victim.reservation
                    victim.context = victim.reservation = None
                    self.ledger.transfer(agent.reservation, owner)
                else:
                    self._free_context(victim)
                continue
            try:
                t0 = time.perf_counter()
                meter = DeviceMeter()
                agent.context = Context(agent.entry.model, self._params(agent.n_ctx))
                switch.context_ms = (time.perf_counter() - t0) * 1e3
            except BaseException:
                self.ledger.release(reservation)
                raise
            agent.reservation = reservation
            self._correct(agent, meter.delta())
        if agent.snapshot is not None:
            t0 = time.perf_counter()
            try:
                agent.snapshot.restore(agent.context, 0)
            except BaseException:
                self._free_context(agent)  # the document stays in the snapshot for the next attempt
                raise
            switch.in_ms = (time.perf_counter() - t0) * 1e3
            switch.in_bytes = agent.snapshot.nbytes
            switch.restored = True
            agent.snapshot.release()
            agent.snapshot = None
        else:
            agent.context.clear()

    def _correct(self, agent: _Agent, measured: int | None) -> None:
        """Replace the derived context estimate with what creating it took, where measurable."""
        if measured is None or agent.reservation is None:
            return
        try:
            self.ledger.resize(agent.reservation, measured)
            agent.context_bytes = measured
        except LedgerDenied:
            pass  # more than estimated and the rest is taken: keep the estimate; STATUS drift shows it

    def _params(self, n_ctx: int) -> ContextParams:
        batch = min(self.n_ubatch, n_ctx)
        return ContextParams(n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, n_threads=self.n_threads)

    @staticmethod
    def _compatible(victim: _Agent, agent: _Agent) -> bool:
        return victim.context is not None and victim.entry is agent.entry and victim.n_ctx == agent.n_ctx

    def _lru_victim(self, agent: _Agent) -> _Agent | None:
        """The least recently used live agent, preferring one whose context ``agent`` can take over.

        Preferring a compatible victim turns a switch into capture + restore in a kept
        context instead of free + create (tens of ms on a GPU, more than the restore).
        """
        live = [a for a in self._agents.values() if a.context is not None and a is not agent]
        compatible = [a for a in live if self._compatible(a, agent)]
        return min(compatible or live, key=lambda a: a.last_used, default=None)

    def _swap_out(self, victim: _Agent, switch: _Switch) -> None:
        """Capture the victim's document into the host pool and empty its sequence."""
        assert victim.context is not None
        if victim.context.seq_len(0) > 0:
            t0 = time.perf_counter()
            victim.snapshot = Snapshot.capture(victim.context, 0, tier="host", pool=self.pool)
            switch.out_ms += (time.perf_counter() - t0) * 1e3
            switch.out_bytes += victim.snapshot.nbytes
            victim.context.clear()
        self._persist(victim)
        switch.evicted.append(victim.agent_id)

    def _free_context(self, agent: _Agent) -> None:
        if agent.context is not None:
            agent.context.close()
            agent.context = None
        if agent.reservation is not None:
            self.ledger.release(agent.reservation)
            agent.reservation = None

    # -- control operations (worker thread) ------------------------------------------------
    def _register(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int) -> dict[str, Any]:
        agent = self._admit(agent_id, model_path, n_ctx)
        with self._cond:
            self._agents[agent_id] = agent
        entry = agent.entry
        return {"agent": agent_id, "model": entry.path.name, "n_ctx": n_ctx, "weights_bytes": entry.reservation.nbytes,
                "context_bytes": agent.context_bytes, "estimate": entry.estimate_source}

    def _admit(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int) -> _Agent:
        """A new agent holding a reference to its (loaded) model, once it is known it can ever run."""
        if agent_id in self._agents:
            raise AgentExists(f"agent {agent_id!r} is already registered")
        shape, weight_bytes = self.registry.peek(model_path)
        context_bytes = context_estimate(shape, n_ctx, self.n_ubatch).total_bytes
        self._check_feasible(agent_id, weight_bytes + context_bytes)
        return _Agent(agent_id, self.registry.acquire(model_path), n_ctx, context_bytes)

    def _check_feasible(self, agent_id: str, request_bytes: int) -> None:
        """Refuse an agent that could never run: even with every context swapped out it does not fit."""
        snap = self.ledger.snapshot()
        evictable = sum(a.reservation.nbytes for a in self._agents.values() if a.reservation is not None)
        if snap.allocated_bytes - evictable + snap.external_bytes + request_bytes > snap.max_bytes:
            raise LedgerDenied(owner=f"agent:{agent_id}", max_bytes=snap.max_bytes,
                               allocated_bytes=snap.allocated_bytes, request_bytes=request_bytes,
                               external_bytes=snap.external_bytes)

    def _unregister(self, agent_id: str) -> None:
        with self._cond:
            agent = self._agents.pop(agent_id, None)
        if agent is None:
            raise UnknownAgent(f"no agent {agent_id!r} is registered")
        self._teardown(agent, UnknownAgent(f"agent {agent_id!r} was unregistered before this request ran"))
        if self.store is not None:
            self.store.remove(agent_id)

    def _teardown(self, agent: _Agent, error: SchedulerError) -> None:
        while agent.queue:
            agent.queue.popleft().future.set_exception(error)
        self._free_context(agent)
        if agent.snapshot is not None:
            agent.snapshot.release()
            agent.snapshot = None
        self.registry.release(agent.entry)

    def _fork(self, source_id: str, agent_id: str) -> dict[str, Any]:
        source = self._agents.get(source_id)
        if source is None:
            raise UnknownAgent(f"no agent {source_id!r} is registered")
        if agent_id in self._agents:
            raise AgentExists(f"agent {agent_id!r} is already registered")
        self._check_feasible(agent_id, source.context_bytes)
        self._activate(source, _Switch())  # a swapped-out source is restored, then copied from its context
        assert source.context is not None
        snapshot = (Snapshot.capture(source.context, 0, tier="host", pool=self.pool)
                    if source.context.seq_len(0) > 0 else None)
        self.registry.acquire(source.entry.path)  # one more reference; cannot be refused, it is resident
        agent = _Agent(agent_id, source.entry, source.n_ctx, source.context_bytes, snapshot=snapshot,
                       served_tokens=source.served_tokens, held_tokens=snapshot.n_tokens if snapshot else 0)
        with self._cond:
            self._agents[agent_id] = agent
        return {"agent": agent_id, "source": source_id, "held_tokens": snapshot.n_tokens if snapshot else 0}

    # -- the state dir (worker thread, or after it stopped) ---------------------------------
    def _persist(self, agent: _Agent) -> None:
        """Save ``agent``'s current state unless the store already has it; a failure is logged, not raised."""
        if self.store is None or agent.persisted:
            return
        live = agent.context if agent.context is not None and agent.context.seq_len(0) > 0 else None
        try:
            snapshot = Snapshot.capture(live, 0, tier="host", pool=self.pool) if live is not None else agent.snapshot
            try:
                record = AgentRecord(agent.agent_id, str(agent.entry.path), agent.entry.model.fingerprint, agent.n_ctx,
                                     snapshot.n_tokens if snapshot is not None else 0, agent.served_tokens)
                self.store.save(record, snapshot)
            finally:
                if live is not None and snapshot is not None:
                    snapshot.release()
        except (KvrtError, OSError) as exc:
            log.warning("agent %r: state not saved to %s: %s", agent.agent_id, self.store.directory, exc)
            return
        agent.persisted = True

    def _restore_all(self) -> None:
        """Bring back every agent saved in the state dir; each one that cannot be is a logged problem."""
        assert self.store is not None
        records, problems = self.store.load()
        for record in records:
            try:
                self._restore(record)
            except (KvrtError, OSError) as exc:
                problems.append(StateProblem(record.agent_id, getattr(exc, "file", record.manifest_name), str(exc)))
            else:
                self.state_restored += 1
        for problem in problems:
            log.warning("saved agent %r not restored (%s): %s", problem.agent_id, problem.file, problem.reason)
        self.state_problems = problems
        log.info("restored %d agent(s) from %s, skipped %d", self.state_restored, self.store.directory, len(problems))

    def _restore(self, record: AgentRecord) -> None:
        """One saved agent back in, swapped out (its KV in host memory); nothing is kept when any check fails."""
        assert self.store is not None
        check_agent_id(record.agent_id)
        agent = self._admit(record.agent_id, record.model_path, record.n_ctx)
        try:
            mismatch = record.fingerprint.mismatch(agent.entry.model.fingerprint)
            if mismatch is not None:
                raise StateFileError(record.manifest_name, f"model {record.model_path} is not the one agent "
                                                           f"{record.agent_id!r} was saved with: {mismatch}")
            agent.snapshot = self.store.load_snapshot(record, self.pool)
        except BaseException:
            self.registry.release(agent.entry)
            raise
        agent.held_tokens, agent.served_tokens, agent.persisted = record.n_tokens, record.served_tokens, True
        with self._cond:
            self._agents[record.agent_id] = agent


def _settle(future: Future[T], fn: Callable[[], T]) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)

