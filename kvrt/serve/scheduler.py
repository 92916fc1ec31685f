"""Agents time-sliced on one device: per-agent queues, a bounded set of live contexts, KV swap.

kvrt keeps as many live agent contexts (:class:`kvrt.serve.agent.Agent`) as the ledger
admits; :class:`kvrt.serve.residency.Residency` swaps the least recently used out to host
memory when one more must run. An agent's history stays exactly its transcript (see
:mod:`kvrt.serve.agent`), and its context policy decides what happens at its limit.

Fairness: **least attained service by tokens** (start-time fair queueing at request
granularity). The next request comes from the backlogged agent that has been served the
fewest tokens (prompt + generated); an agent that was idle re-enters at the current
minimum, so idling banks no credit. Among equals, an agent whose context is live goes
first (a free hit instead of a swap), then the least recently run. A request once
started runs to completion, so time-slicing never forces a swap in the middle of a
generation. No agent starves: every service raises the served count of the agent that
got it.

Every llama.cpp call is made from the scheduler's one worker thread, except the
prefetcher's restores and captures (:mod:`kvrt.serve.prefetch`, on by default): while a
turn runs, the agent that runs next is moved into a context of its own on a copy
thread, so its swap-in waits only for what is left of the copy. Other threads only
enqueue and wait on futures. With a ``state_dir`` (:mod:`kvrt.serve.statedir`) agents
outlive the process.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvrt.accounting.ledger import VramLedger
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.prompt import prompt_tokens
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import InvalidArgument
from kvrt.serve.agent import Agent, ContextPolicy
from kvrt.serve.forking import fork
from kvrt.serve.membership import admit, teardown
from kvrt.serve.prefetch import Prefetcher
from kvrt.serve.registry import ModelRegistry
from kvrt.serve.residency import Residency, Switch
from kvrt.serve.results import (
    AgentInfo,
    DecodeResult,
    Forked,
    MetricsSummary,
    Registered,
    RequestMetrics,
    SchedulerClosed,
    UnknownAgent,
    check_agent_id,
    ended_early,
)
from kvrt.serve.service import HISTORY, AgentService, TextFn
from kvrt.serve.statedir import persist, persist_new, restore_all
from kvrt.serve.turn import Turn
from kvrt.state.agentstore import AgentStore, StateProblem
from kvrt.state.hostpool import HostPool

T = TypeVar("T")
log = logging.getLogger("kvrt.serve.scheduler")


class Scheduler(AgentService[Agent]):
    """Register agents on models, queue their requests, run them fairly on one device.

    ``ledger`` admits weights and contexts; ``registry`` shares models (one is made on
    ``ledger`` when not given). ``n_threads`` and ``flash_attn`` are passed to every
    context; ``pool`` is the host pool that swapped-out states live in. ``state_dir``
    keeps agents across restarts: those saved there are restored before the constructor
    returns. ``prefetch`` (default on) restores the next agent's state while the current
    one decodes (:mod:`kvrt.serve.prefetch`); off, every swap-in is a synchronous restore
    at the start of its turn. Either way the agents' tokens are the same.
    """

    def __init__(self, ledger: VramLedger, registry: ModelRegistry | None = None, *, n_ubatch: int = 512,
                 n_threads: int | None = None, flash_attn: str = "auto", pool: HostPool | None = None,
                 state_dir: str | os.PathLike[str] | None = None, prefetch: bool = True) -> None:
        if registry is not None and registry.devices is not None:
            raise InvalidArgument("per-agent contexts are swapped in and out against one ledger; a registry on a "
                                  "device set needs the batched service (kvrt serve --batch-slots)")
        self.ledger = ledger
        self.registry = registry or ModelRegistry(ledger)
        self._owns_registry = registry is None
        self.n_ubatch = n_ubatch
        self.n_threads = n_threads
        self.flash_attn = flash_attn
        self.pool = pool
        self._agents: dict[str, Agent] = {}
        self.residency = Residency(ledger, self._agents, pool=pool, n_ubatch=n_ubatch, n_threads=n_threads,
                                   flash_attn=flash_attn, on_evict=lambda agent: persist(self, agent),
                                   measure=self.registry.measure)
        self.prefetcher = Prefetcher(self.residency) if prefetch else None
        self.residency.prefetcher = self.prefetcher
        self._control: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._cond = threading.Condition()
        self._clock = itertools.count(1)
        self._history: deque[RequestMetrics] = deque(maxlen=HISTORY)
        self._closing = False
        self._busy = False  # the worker is running a job (set and cleared under the lock)
        self._running: tuple[Agent, Turn] | None = None  # the turn generating now (set and cleared under the lock)
        self.store = AgentStore(state_dir) if state_dir is not None else None
        self.state_problems: list[StateProblem] = []
        self.state_restored = 0
        self._worker = threading.Thread(target=self._run, name="kvrt-scheduler", daemon=True)
        self._worker.start()
        if self.store is not None:
            self.state_restored, self.state_problems = self._call(lambda: restore_all(self))

    # -- public API (any thread) --------------------------------------------------------
    def register(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int = 4096, *,
                 policy: str = "refuse", min_ctx: int | None = None, keep: int | None = None) -> Registered:
        """Admit an agent on ``model_path`` whose history may hold ``n_ctx`` cells, under ``policy``.

        ``policy`` is ``refuse``, ``shift`` (with ``keep``) or ``grow`` (from ``min_ctx``);
        see :class:`kvrt.serve.agent.ContextPolicy`. Refused with
        :class:`kvrt.accounting.ledger.LedgerDenied` when the model's weights plus its first
        context cannot fit even with every other agent swapped out.
        """
        check_agent_id(agent_id)
        rules = ContextPolicy(policy, n_ctx, min_ctx, keep)
        return self._call(lambda: self._register(agent_id, model_path, rules))

    def unregister(self, agent_id: str) -> None:
        """Remove an agent: queued requests fail, its context, state and model reference go."""
        self._call(lambda: self._unregister(agent_id))

    def fork(self, source_id: str, agent_id: str) -> Forked:
        """A new agent that starts from a copy of ``source_id``'s history (same model, size and policy)."""
        check_agent_id(agent_id)
        return self._call(lambda: self._fork(source_id, agent_id))

    def submit(self, agent_id: str, prompt: str | Sequence[int], n_tokens: int, *,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), deadline: float | None = None,
               on_text: TextFn | None = None) -> Future[DecodeResult]:
        """Queue ``prompt`` (appended to the agent's history) and up to ``n_tokens`` of generation.

        ``on_text`` receives the reply's text piece by piece as it is sampled (on the worker thread; it
        must not block).
        """
        params = GenerationParams(max_tokens=n_tokens, stop=tuple(stop), sampling=sampling or SamplingParams())
        turn = Turn(prompt, params, Future(), deadline, on_text)
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the scheduler is shutting down")
            agent = self._agent(agent_id)
            if not agent.queue:
                backlogged = [a.served_tokens for a in self._agents.values() if a.queue]
                agent.served_tokens = max(agent.served_tokens, min(backlogged, default=agent.served_tokens))
            agent.queue.append(turn)
            self._cond.notify()
        return turn.future

    def cancel(self, agent_id: str) -> int:
        """End the agent's queued turns with ``cancelled`` and stop its running one at its next token;
        returns how many."""
        with self._cond:
            agent = self._agent(agent_id)
            turns = list(agent.queue)
            agent.queue.clear()
            running = self._running if self._running is not None and self._running[0] is agent else None
            if running is not None:
                running[1].cancelled = True
            if self.prefetcher is not None and not self._closing:  # the worker unstages it (settle, after any job)
                self._control.append((lambda: None, Future()))
                self._cond.notify()
        now = time.perf_counter()
        for turn in turns:
            turn.future.set_result(ended_early(agent_id, "cancelled", (now - turn.submitted) * 1e3))
        return len(turns) + (running is not None)

    def activate(self, agent_id: str) -> None:
        """Give the agent its live context now (swapping others out if needed), ahead of its next turn."""
        self._call(lambda: self.residency.activate(self._agent(agent_id), Switch()))

    def transcript(self, agent_id: str) -> list[int]:
        """Every token of the agent's history, in order (what a recompute of it would prefill)."""
        return self._call(lambda: list(self._agent(agent_id).transcript))

    def agents(self) -> list[AgentInfo]:
        with self._cond:
            return [AgentInfo(a.agent_id, a.entry.path.name, a.n_ctx, a.policy.n_ctx, a.policy.mode, a.state,
                              a.context_bytes, len(a.queue), a.requests, a.served_tokens, a.held_tokens)
                    for a in self._agents.values()]

    def metrics(self, agent_id: str | None = None) -> MetricsSummary:
        """Request count, tokens, swap totals and latency/queue-wait percentiles (ms)."""
        with self._cond:
            if agent_id is not None:
                self._agent(agent_id)
            rows = [m for m in self._history if agent_id is None or m.agent_id == agent_id]
        return MetricsSummary.of(rows)

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
        if self.prefetcher is not None:
            self.prefetcher.close()  # staged prefetches cancelled; every agent keeps its snapshot
        for agent in self._agents.values():
            persist(self, agent)
        for agent in list(self._agents.values()):
            teardown(self, agent, SchedulerClosed("the scheduler shut down before this request ran"))
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
                    agent = min((a for a in self._agents.values() if a.queue), key=_order)
                    job = functools.partial(self._serve, agent, agent.queue.popleft())
                self._busy = True
            try:
                job()
                if self.prefetcher is not None:
                    self.prefetcher.settle()  # between two jobs no copy is in flight (kvrt.serve.prefetch)
            except BaseException:  # a bug in one job must not stop every agent's queue
                log.exception("scheduler job failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _serve(self, agent: Agent, turn: Turn) -> None:
        """One turn: make room under the agent's policy, feed what its KV lacks plus the prompt, generate."""
        if not turn.future.set_running_or_notify_cancel():
            return
        started = time.perf_counter()
        if turn.deadline is not None and time.monotonic() >= turn.deadline:
            turn.future.set_result(ended_early(agent.agent_id, "deadline", (started - turn.submitted) * 1e3))
            return
        switch = Switch()
        shifted = 0
        try:
            prompt = prompt_tokens(agent.entry.model, turn.prompt, "prompt", add_special=not agent.transcript,
                                   error=InvalidArgument)
            agent.resolve_keep(len(prompt))
            plan = agent.plan(len(prompt), turn.params.max_tokens)
            agent.persisted = False  # from here on the turn changes the agent's state (it is saved after it)
            self.residency.prepare(agent, plan.size, switch)
            assert agent.context is not None
            if plan.drop:
                agent.shift(plan)
                shifted = plan.drop
            start = agent.kv_tokens
            self._stage_next(agent, len(prompt))
            began = time.perf_counter()
            with self._cond:
                self._running = (agent, turn)
            try:
                completion = generate(agent.context, agent.transcript[start:] + prompt, turn.params,
                                      on_text=turn.on_text, until=turn.end_reason)
            except BaseException:
                agent.context.seq_rm(0, start, -1)  # back to the turn's start: the history is unchanged
                raise
            finally:
                with self._cond:
                    self._running = None
        except BaseException as exc:
            persist(self, agent)  # what a failed turn changed (a shift) is kept, and saved, like a turn's
            turn.future.set_exception(exc)
            return
        finally:
            agent.last_used = next(self._clock)
        agent.transcript += prompt + completion.sampled
        agent.kv_tokens = len(agent.transcript) - 1  # generate leaves the last sampled token undecoded
        agent.check()
        done = time.perf_counter()
        timings = completion.timings_ms
        metrics = RequestMetrics(
            agent_id=agent.agent_id, queue_wait_ms=(started - turn.submitted) * 1e3,
            swap_out_bytes=switch.out_bytes, swap_out_ms=switch.out_ms, swap_in_bytes=switch.in_bytes,
            swap_in_ms=switch.in_ms, context_ms=switch.context_ms,
            decode_ms=timings.get("prefill_ms", 0.0) + timings.get("decode_ms", 0.0),
            latency_ms=(done - turn.submitted) * 1e3, prompt_tokens=len(prompt),
            generated_tokens=len(completion.tokens), shifted_tokens=shifted,
            first_token_ms=(began - turn.submitted) * 1e3 + timings.get("first_token_ms", 0.0))
        with self._cond:
            agent.served_tokens += len(prompt) + len(completion.tokens)
            agent.requests += 1
            self._history.append(metrics)
        unsaved = persist(self, agent)  # before the result is handed out: a crash after it loses nothing
        turn.future.set_result(DecodeResult(agent.agent_id, completion.text, completion.tokens,
                                            completion.finish_reason, tuple(switch.evicted), switch.restored,
                                            metrics, unsaved))

    def _stage_next(self, running: Agent, prompt: int) -> None:
        """Prefetch the agent whose turn comes after ``running``'s (whose served count rises by at least ``prompt``)."""
        if self.prefetcher is None:
            return
        with self._cond:
            following = min((a for a in self._agents.values() if a.queue and a is not running), key=_order,
                            default=None)
            if following is None or (running.queue and following.served_tokens > running.served_tokens + prompt):
                return  # nobody waits, or the running agent's own next turn comes first
        self.prefetcher.stage(following, running)

    # -- activation, growth and swap ----------------------------------------------------------
    def _register(self, agent_id: str, model_path: str | os.PathLike[str], policy: ContextPolicy) -> Registered:
        agent = admit(self, agent_id, model_path, policy, policy.first_ctx)
        self.add(agent)
        persist_new(self, agent)
        entry = agent.entry
        return Registered(agent_id, entry.path.name, agent.n_ctx, policy.n_ctx, policy.mode,
                          entry.reservation.nbytes, agent.context_bytes, entry.estimate_source)

    def _fork(self, source_id: str, agent_id: str) -> Forked:
        forked = fork(self, source_id, agent_id)
        persist_new(self, self._agents[agent_id])
        return forked

    def add(self, agent: Agent) -> None:
        """Make an admitted agent schedulable (worker only)."""
        with self._cond:
            self._agents[agent.agent_id] = agent

    def _unregister(self, agent_id: str) -> None:
        with self._cond:
            agent = self._agents.pop(agent_id, None)
        if agent is None:
            raise UnknownAgent(f"no agent {agent_id!r} is registered")
        teardown(self, agent, UnknownAgent(f"agent {agent_id!r} was unregistered before this request ran"))
        if self.store is not None:
            self.store.remove(agent_id)


def _order(agent: Agent) -> tuple[int, bool, int]:
    """The fairness order (module docstring): least served tokens, then a live context, then least recently run."""
    return agent.served_tokens, agent.context is None, agent.last_used


def _settle(future: Future[T], fn: Callable[[], T]) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)
