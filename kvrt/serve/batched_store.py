"""The batched scheduler's agents in a state directory (:mod:`kvrt.state.agentstore`): saved as transcripts.

A batched agent's KV lives in cells of its model's shared context, beside other agents'
(and in the engine's host tier once evicted), so what outlives the process is its
registration and its exact transcript. An agent is saved when it is registered or forked
and after each of its turns, before the turn's result is handed out (a crash loses at
most the turns still running), again when the scheduler closes, and forgotten when it is
unregistered; a new scheduler on the same directory registers them again, and each
one's next turn prefills its transcript (a turn after a restart costs a prefill; its
tokens are those of the same history never stopped). A saved agent that cannot come
back (damaged file, another model now at that path) is skipped and listed in
``state_problems``.

Saves run on whichever thread finished the turn (the engine's, mostly), under the agent's
``save_lock`` and never under the scheduler's lock; the record is read when the save
starts, so of two saves of one agent the later one writes its latest transcript, and one
of an agent unregistered meanwhile writes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Protocol

from kvrt.errors import KvrtError
from kvrt.serve.batched_agent import BatchedAgent
from kvrt.serve.registry import ModelRegistry
from kvrt.serve.results import Registered
from kvrt.serve.statedir import check_model, record_policy, restore_each
from kvrt.state.agentstore import AgentRecord, AgentStore, StateProblem

log = logging.getLogger("kvrt.serve.batched_store")


class BatchedView(Protocol):
    """What saving and restoring use of :class:`kvrt.serve.batched.BatchedScheduler` (which imports this module):
    its store and registry, its agents (changed only under ``_lock``) and its registration without the save."""

    @property
    def store(self) -> AgentStore | None: ...

    @property
    def registry(self) -> ModelRegistry: ...

    @property
    def _lock(self) -> threading.RLock: ...

    @property
    def _agents(self) -> dict[str, BatchedAgent]: ...

    def _register(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int, *, policy: str,
                  min_ctx: int | None, keep: int | None) -> Registered: ...


def save(sched: BatchedView, agent: BatchedAgent) -> str | None:
    """Save ``agent``'s registration and transcript (no KV: ``n_tokens`` 0) unless the store has them already.

    Returns why they could not be saved (the store logged it and keeps it in ``unsaved``), or None.
    """
    store = sched.store
    if store is None:
        return None
    with agent.save_lock:
        with sched._lock:
            if sched._agents.get(agent.agent_id) is not agent or agent.version == agent.saved_version:
                return None  # unregistered meanwhile, or saved as it is
            version = agent.version
            record = AgentRecord(agent.agent_id, str(agent.pool.entry.path), agent.pool.entry.model.fingerprint,
                                 agent.policy.n_ctx, 0, agent.served_tokens, tuple(agent.transcript),
                                 agent.policy.as_record(), agent.keep)
        try:
            store.save(record, None)
        except KvrtError as exc:
            return str(exc)
        agent.saved_version = version
    return None


def forget(sched: BatchedView, agent: BatchedAgent) -> None:
    """Remove an unregistered agent's files (after it left ``sched._agents``: no save of it starts again)."""
    if sched.store is not None:
        with agent.save_lock:
            sched.store.remove(agent.agent_id)


def restore_all(sched: BatchedView) -> tuple[int, list[StateProblem]]:
    """Register every agent saved in the state dir again, with its transcript: how many came back, and a problem
    for each one that could not."""
    store = sched.store
    assert store is not None
    return restore_each(store, lambda record: _restore(sched, record))


def _restore(sched: BatchedView, record: AgentRecord) -> None:
    policy = record_policy(record)
    entry = sched.registry.acquire(record.model_path)  # checked before anything is registered; held meanwhile
    try:
        check_model(record, entry.model)
        sched._register(record.agent_id, record.model_path, policy.n_ctx, policy=policy.mode,
                        min_ctx=policy.min_ctx, keep=policy.keep)
    finally:
        sched.registry.release(entry)  # the agent's pool holds the model now
    agent = sched._agents[record.agent_id]
    agent.transcript, agent.keep, agent.served_tokens = list(record.transcript), record.keep, record.served_tokens
    agent.saved_version = agent.version  # what the directory holds
