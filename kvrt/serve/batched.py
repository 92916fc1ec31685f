"""Agents decoded together: each model's agents are sequences of one shared context, one batch per step.

:class:`BatchedScheduler` has the :class:`kvrt.serve.scheduler.Scheduler` interface the
daemon uses, over one :class:`kvrt.runtime.batching.Engine` per model (a unified-KV
context of ``BatchConfig.n_ctx`` cells and ``n_seq_max`` slots, charged to the ledger
when the model's first agent registers). Every step of an engine puts the next token of
every decoding agent and a prompt chunk of every prefilling one into one
``llama_decode``, so a long generation never holds the others back (token-level
preemption), and each turn samples with its own parameters, honours its deadline and
can be cancelled between two tokens.

An agent is its transcript (see :mod:`kvrt.serve.agent`). A turn asks the engine for
transcript + prompt; the engine's prefix cache finds the cells the agent's previous turn
left (all of its transcript but the last sampled token) and prefills only the rest, so
the agent's KV is always its transcript. A fork is a copy of the transcript whose first
turn shares the parent's cells with ``seq_cp``. When cells run short the least recently
used agent's cells are evicted: copied to the engine's host tier (``BatchConfig.host_bytes``,
pinned memory on a GPU machine, :func:`kvrt.state.hostpool.host_memory`) while it has room, so its next
turn restores them; otherwise that turn prefills its transcript again. Either way exact.
One agent's turns run one after another, in order.

Context policies: ``refuse`` and ``grow`` refuse a turn past the agent's ``n_ctx`` (in a
shared pool an agent only ever holds the cells its tokens use, plus its running turn's
``max_tokens``); ``shift`` drops the oldest tokens after the kept prefix from the
transcript and the next turn recomputes what follows them.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

from kvrt.accounting.devices import DeviceCharge
from kvrt.accounting.estimate import context_estimate
from kvrt.accounting.ledger import Reservation, VramLedger
from kvrt.engine.generation import GenerationParams
from kvrt.engine.prompt import prompt_tokens
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import InvalidArgument
from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import ChoiceEnd, EngineStats, Request, RequestEnd, TokenEvent
from kvrt.serve.agent import ContextPolicy
from kvrt.serve.batched_agent import BatchedAgent, BatchedPool, BatchedTurn
from kvrt.serve.batched_store import forget, restore_all, save
from kvrt.serve.registry import LoadedModel, ModelRegistry
from kvrt.serve.results import (
    AgentExists,
    AgentInfo,
    DecodeResult,
    Forked,
    MetricsSummary,
    Registered,
    RequestMetrics,
    SchedulerClosed,
    check_agent_id,
    ended_early,
)
from kvrt.serve.service import HISTORY, AgentService, TextFn
from kvrt.state.agentstore import AgentStore, AgentStoreError, StateProblem

log = logging.getLogger("kvrt.serve.batched")


@dataclass(frozen=True)
class BatchConfig:
    """One model's shared context: ``n_ctx`` cells for all its agents, ``n_seq_max`` turns at once."""

    n_ctx: int = 8192
    n_seq_max: int = 64
    n_batch: int = 2048  # a burst of turns (every agent answered at once) prefills in one step
    prefill_chunk: int = 256
    n_threads: int | None = None
    flash_attn: str = "auto"
    host_bytes: int = 2 << 30  # host copies of evicted agents' histories: a returning one is restored, not prefilled
    kv_layout: str = EngineConfig.kv_layout
    pad_gaps: bool = EngineConfig.pad_gaps
    even_chunks: bool = EngineConfig.even_chunks
    decode_wait_s: float = EngineConfig.decode_wait_s
    hold_s: float = EngineConfig.hold_s
    backend_sampling: bool = EngineConfig.backend_sampling
    host_write_behind: bool = EngineConfig.host_write_behind
    warmup: str = EngineConfig.warmup

    def engine(self) -> EngineConfig:
        return EngineConfig(n_ctx=self.n_ctx, n_seq_max=self.n_seq_max, n_batch=self.n_batch,
                            prefill_chunk=self.prefill_chunk, max_queue=1 << 20, n_threads=self.n_threads,
                            flash_attn=self.flash_attn, host_bytes=self.host_bytes, kv_layout=self.kv_layout,
                            pad_gaps=self.pad_gaps, even_chunks=self.even_chunks, decode_wait_s=self.decode_wait_s,
                            hold_s=self.hold_s, backend_sampling=self.backend_sampling,
                            host_write_behind=self.host_write_behind, warmup=self.warmup)


class BatchedScheduler(AgentService[BatchedAgent]):
    """Register agents on models and run their turns in continuous batches (see the module docstring)."""

    def __init__(self, ledger: VramLedger, registry: ModelRegistry | None = None, *,
                 config: BatchConfig | None = None, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.ledger = ledger
        self.registry = registry or ModelRegistry(ledger)
        self._owns_registry = registry is None
        self.config = config or BatchConfig()
        self._pools: dict[Path, BatchedPool] = {}
        self._agents: dict[str, BatchedAgent] = {}
        self._lock = threading.RLock()
        self._history: deque[RequestMetrics] = deque(maxlen=HISTORY)
        self._closing = False
        self.store = AgentStore(state_dir) if state_dir is not None else None  # kvrt.serve.batched_store
        self.state_problems: list[StateProblem] = []
        self.state_restored = 0
        if self.store is not None:
            self.state_restored, self.state_problems = restore_all(self)

    # -- agents -------------------------------------------------------------------------
    def register(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int = 4096, *,
                 policy: str = "refuse", min_ctx: int | None = None, keep: int | None = None) -> Registered:
        """Admit an agent; the model's first agent loads it and charges its shared context to the ledger.

        With a state dir the agent is saved before this returns; when that fails it is removed
        again and :class:`kvrt.state.agentstore.AgentStoreError` raised."""
        registered = self._register(agent_id, model_path, n_ctx, policy=policy, min_ctx=min_ctx, keep=keep)
        self._saved_or_removed(self._agents[agent_id])
        return registered

    def _register(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int, *, policy: str,
                  min_ctx: int | None, keep: int | None) -> Registered:
        """:meth:`register` without the save (a restore registers an agent the directory holds)."""
        check_agent_id(agent_id)
        rules = ContextPolicy(policy, n_ctx, min_ctx, keep)
        if n_ctx > self.config.n_ctx:
            raise InvalidArgument(f"n_ctx {n_ctx} exceeds the {self.config.n_ctx} cells a model's agents share")
        with self._lock:
            self._open()
            if agent_id in self._agents:
                raise AgentExists(f"agent {agent_id!r} is already registered")
            pool = self._pool(model_path)
            pool.agents += 1
            self._agents[agent_id] = BatchedAgent(agent_id, pool, rules)
        entry = pool.entry
        return Registered(agent_id, entry.path.name, n_ctx, n_ctx, rules.mode, entry.reservation.nbytes,
                          pool.reservation.nbytes, entry.estimate_source)

    def _pool(self, model_path: str | os.PathLike[str]) -> BatchedPool:
        shape, _ = self.registry.peek(model_path)
        entry = self.registry.acquire(model_path)
        pool = self._pools.get(entry.path)
        if pool is not None:
            self.registry.release(entry)  # the pool holds the model's one reference
            return pool
        try:
            cells = context_estimate(shape, self.config.n_ctx, min(self.config.n_batch, 512)).total_bytes
            reservation = self._charge(entry, cells)
        except BaseException:
            self.registry.release(entry)
            raise
        try:
            engine = Engine(entry.model, self.config.engine())  # its host tier pinned on a GPU
        except BaseException:
            self._give_back(reservation)
            self.registry.release(entry)
            raise
        pool = self._pools[entry.path] = BatchedPool(entry, engine, reservation)
        return pool

    def _charge(self, entry: LoadedModel, cells: int) -> Reservation | DeviceCharge:
        """A model's shared context charged where the model is: each device of its placement by its share (a
        registry on a device set), else this scheduler's ledger."""
        owner = f"batch:{entry.path.name}"
        if entry.placement is not None:
            return self.registry.charge(entry, cells, owner)
        return self.ledger.try_reserve(cells, owner)

    def _give_back(self, charge: Reservation | DeviceCharge) -> None:
        if isinstance(charge, DeviceCharge):
            self.registry.give_back(charge)
        else:
            self.ledger.release(charge)

    def unregister(self, agent_id: str) -> None:
        """Remove an agent: its queued and running turns end ``cancelled``; the last agent of a model frees it."""
        with self._lock:
            agent = self._agent(agent_id)
            del self._agents[agent_id]
        try:
            forget(self, agent)
        finally:
            self._release(agent)

    def _release(self, agent: BatchedAgent) -> None:
        """End what an agent no longer registered had running and queued; free its model when it was the last."""
        self._cancel(agent)
        with self._lock:
            agent.pool.agents -= 1
            idle = (agent.pool.agents == 0 and agent.running is None
                    and self._pools.pop(agent.pool.entry.path, None) is not None)
        if idle:
            self._close_pool(agent.pool)

    def _close_pool(self, pool: BatchedPool) -> None:
        """Stop a pool's engine and free it (never under the lock: the engine's thread may be waiting for it)."""
        pool.engine.close()
        self._give_back(pool.reservation)
        self.registry.release(pool.entry)

    def fork(self, source_id: str, agent_id: str) -> Forked:
        """A new agent with a copy of the source's history; its first turn shares the source's cells."""
        check_agent_id(agent_id)
        with self._lock:
            self._open()
            source = self._agent(source_id)
            if agent_id in self._agents:
                raise AgentExists(f"agent {agent_id!r} is already registered")
            source.pool.agents += 1
            agent = self._agents[agent_id] = BatchedAgent(agent_id, source.pool, source.policy,
                                                          list(source.transcript), source.keep,
                                                          served_tokens=source.served_tokens)
        self._saved_or_removed(agent)
        return Forked(agent_id, source_id, len(agent.transcript))

    def _saved_or_removed(self, agent: BatchedAgent) -> None:
        """Save a just-admitted agent; when that fails, remove it again and raise why (never OK while unsaved)."""
        error = save(self, agent)
        if error is not None:
            with self._lock:
                del self._agents[agent.agent_id]
            self._release(agent)
            assert self.store is not None
            self.store.refused(agent.agent_id)
            raise AgentStoreError(error)

    def transcript(self, agent_id: str) -> list[int]:
        with self._lock:
            return list(self._agent(agent_id).transcript)

    def engine_stats(self) -> dict[str, EngineStats]:
        """Each loaded model's engine counters (steps, tokens, time in steps and in llama_decode), by file name."""
        with self._lock:
            pools = list(self._pools.values())
        return {pool.entry.path.name: pool.engine.stats() for pool in pools}

    # -- turns --------------------------------------------------------------------------
    def submit(self, agent_id: str, prompt: str | Sequence[int], n_tokens: int, *,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), deadline: float | None = None,
               on_text: TextFn | None = None) -> Future[DecodeResult]:
        """Queue a turn; it starts when the agent's previous one ended. ``on_text`` gets each piece of
        text as it is sampled (on the engine's thread; it must not block or raise)."""
        params = GenerationParams(max_tokens=n_tokens, stop=tuple(stop), sampling=sampling or SamplingParams())
        turn = BatchedTurn(prompt, params, deadline, on_text)
        with self._lock:
            self._open()
            agent = self._agent(agent_id)
            agent.queue.append(turn)
            started = self._start(agent) if agent.running is None else None
        self._drain(agent, started)
        return turn.future

    def cancel(self, agent_id: str) -> int:
        """End the agent's running turn (between two tokens) and its queued ones; returns how many."""
        with self._lock:
            agent = self._agent(agent_id)
        return self._cancel(agent)

    def _cancel(self, agent: BatchedAgent) -> int:
        with self._lock:
            turns = list(agent.queue)
            agent.queue.clear()
            running = agent.running
        now = time.perf_counter()
        for turn in turns:
            turn.future.set_result(ended_early(agent.agent_id, "cancelled", (now - turn.submitted) * 1e3))
        if running is not None and running.stream is not None:
            running.stream.cancel()
        return len(turns) + (running is not None)

    def _start(self, agent: BatchedAgent) -> BatchedTurn | None:
        """Send the agent's next queued turn to its engine (lock held); refusals end that turn and go on.

        Returns the turn started: the caller drains it once the lock is released (its first
        events may have come before its stream was known).
        """
        while agent.queue and agent.running is None:
            turn = agent.queue.popleft()
            if not turn.future.set_running_or_notify_cancel():
                continue
            try:
                request = self._request(agent, turn)
                agent.running = turn
                turn.stream = agent.pool.engine.submit(request, notify=functools.partial(self._drain, agent, turn))
            except BaseException as exc:
                agent.running = None
                turn.future.set_exception(exc)
                continue
            return turn
        return None

    def _request(self, agent: BatchedAgent, turn: BatchedTurn) -> Request:
        """The engine request for ``turn``: transcript + prompt, after the agent's policy made room."""
        model = agent.pool.entry.model
        turn.tokens = prompt_tokens(model, turn.prompt, "prompt", add_special=not agent.transcript,
                                    error=InvalidArgument)
        if agent.keep is None:
            agent.keep = agent.policy.first_keep(len(turn.tokens))
        room = agent.policy.make_room(agent.agent_id, len(agent.transcript), 0, agent.keep, len(turn.tokens),
                                      turn.params.max_tokens)
        if room is not None:
            keep, drop = room
            del agent.transcript[keep:keep + drop]
            agent.version += 1
        deadline = turn.deadline
        return Request(agent.transcript + turn.tokens, turn.params, deadline=deadline)

    def _drain(self, agent: BatchedAgent, turn: BatchedTurn | None) -> None:
        """Forward the turn's engine events (engine thread, or the starter right after the submit)."""
        if turn is None or turn.stream is None:
            return  # called before submit returned; the submitter drains next
        with turn.drained:
            while (event := turn.stream.poll()) is not None:
                if isinstance(event, TokenEvent):
                    turn.first_token = turn.first_token or time.perf_counter()
                    if event.text and turn.on_text is not None:
                        turn.on_text(event.text)
                elif isinstance(event, ChoiceEnd):
                    turn.end = event
                    if event.rest and turn.on_text is not None:
                        turn.on_text(event.rest)
                else:
                    self._finish(agent, turn, event)

    def _finish(self, agent: BatchedAgent, turn: BatchedTurn, end: RequestEnd) -> None:
        """The turn is over: the history grows by the prompt and every sampled token; the next turn starts."""
        done = time.perf_counter()
        choice = turn.end
        if end.error is None and choice is not None:
            sampled = list(choice.tokens) + ([choice.ended_by] if choice.ended_by is not None else [])
            metrics = RequestMetrics(
                agent.agent_id, 0.0, 0, 0.0, 0, 0.0, 0.0, (done - turn.submitted) * 1e3, (done - turn.submitted) * 1e3,
                len(turn.tokens), len(choice.tokens),
                first_token_ms=((turn.first_token or done) - turn.submitted) * 1e3)
            result = DecodeResult(agent.agent_id, choice.text, list(choice.tokens), choice.finish_reason, (), False,
                                  metrics)
        started = None
        with self._lock:
            agent.running = None
            if end.error is None and choice is not None:
                agent.transcript += turn.tokens + sampled
                agent.version += 1
                agent.served_tokens += len(turn.tokens) + len(choice.tokens)
                agent.requests += 1
                self._history.append(metrics)
            if self._agents.get(agent.agent_id) is agent:
                started = self._start(agent)
            elif agent.pool.agents == 0 and self._pools.pop(agent.pool.entry.path, None) is not None:
                # its last agent left mid-turn: free it off this (the engine's) thread, which close() joins
                threading.Thread(target=self._close_pool, args=(agent.pool,), daemon=True).start()
        if end.error is not None or choice is None:
            turn.future.set_exception(end.error or SchedulerClosed("the turn ended without a result"))
        else:  # saved before the result is handed out: a crash after it loses nothing
            turn.future.set_result(replace(result, unsaved=save(self, agent)))
        self._drain(agent, started)

    # -- views and shutdown ---------------------------------------------------------------

    def _open(self) -> None:
        if self._closing:
            raise SchedulerClosed("the scheduler is shutting down")

    def agents(self) -> list[AgentInfo]:
        with self._lock:
            return [AgentInfo(a.agent_id, a.pool.entry.path.name, a.policy.n_ctx, a.policy.n_ctx, a.policy.mode,
                              "active" if a.running is not None else "cached", 0, len(a.queue), a.requests,
                              a.served_tokens, len(a.transcript))
                    for a in self._agents.values()]

    def metrics(self, agent_id: str | None = None) -> MetricsSummary:
        with self._lock:
            if agent_id is not None:
                self._agent(agent_id)
            return MetricsSummary.of([m for m in self._history if agent_id is None or m.agent_id == agent_id])

    def history(self) -> list[RequestMetrics]:
        with self._lock:
            return list(self._history)

    def close(self, timeout: float | None = None) -> bool:
        """Cancel every turn, stop the engines (running turns end with an error) and free what they held."""
        with self._lock:
            if self._closing:
                return True
            self._closing = True
            agents = list(self._agents.values())
        for agent in agents:
            with self._lock:
                turns = list(agent.queue)
                agent.queue.clear()
            for turn in turns:
                turn.future.set_exception(SchedulerClosed("the scheduler shut down before this request ran"))
        for agent in agents:
            save(self, agent)  # what changed and was not saved yet (a failed save is retried)
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
            self._agents.clear()
        for pool in pools:
            self._close_pool(pool)
        if self.store is not None:
            self.store.close()
        if self._owns_registry:
            self.registry.close()
        return True
