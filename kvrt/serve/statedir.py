"""The scheduler's agents in a state directory (:mod:`kvrt.state.agentstore`): saved, and brought back.

An agent is saved when it is registered or forked and after each of its turns, before
the turn's result is handed out, so a crash (``kill -9``) loses at most the turns still
running; a new scheduler on the same directory brings them back swapped out, and their
next request continues from the saved KV and transcript exactly as if the process had
never stopped. An agent whose state did not change is not written again (``persisted``).
A saved agent that cannot be restored (damaged file, changed model, no room) is skipped
and listed in :attr:`Scheduler.state_problems`; one whose save failed stays in
:attr:`kvrt.state.agentstore.AgentStore.unsaved` until a later save succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvrt.engine.model import Model
from kvrt.errors import KvrtError
from kvrt.serve.agent import Agent, ContextPolicy
from kvrt.serve.membership import admit, teardown
from kvrt.serve.results import UnknownAgent, check_agent_id
from kvrt.serve.scheduler_view import SchedulerView
from kvrt.state.agentstore import AgentRecord, AgentStore, AgentStoreError, StateFileError, StateProblem

log = logging.getLogger("kvrt.serve.statedir")


def persist(sched: SchedulerView, agent: Agent) -> str | None:
    """Save ``agent``'s current state unless the store already has it (worker thread).

    Returns why it could not be saved (the store logged it and keeps it in ``unsaved``), or None.
    """
    store = sched.store
    if store is None or agent.persisted:
        return None
    live = agent.snapshot is None and agent.context is not None
    try:
        snapshot = agent.kv.capture(agent.transcript[:agent.kv_tokens]) if live else agent.snapshot
        try:
            record = AgentRecord(agent.agent_id, str(agent.entry.path), agent.entry.model.fingerprint, agent.n_ctx,
                                 agent.kv_tokens, agent.served_tokens, tuple(agent.transcript),
                                 agent.policy.as_record(), agent.keep)
            store.save(record, snapshot)
        finally:
            if live and snapshot is not None:
                snapshot.release()
    except KvrtError as exc:
        return str(exc)
    agent.persisted = True
    return None


def persist_new(sched: SchedulerView, agent: Agent) -> None:
    """Save a just-admitted agent (registered or forked); when that fails it is removed again and the
    :class:`AgentStoreError` raised: an agent the state dir does not hold is never admitted with OK."""
    error = persist(sched, agent)
    if error is not None:
        with sched._cond:
            del sched._agents[agent.agent_id]
        teardown(sched, agent, UnknownAgent(f"agent {agent.agent_id!r} could not be saved"))
        assert sched.store is not None
        sched.store.refused(agent.agent_id)
        raise AgentStoreError(error)


def restore_all(sched: SchedulerView) -> tuple[int, list[StateProblem]]:
    """Bring back every agent saved in the state dir (worker thread): how many came back, and a problem for each
    one that could not."""
    store = sched.store
    assert store is not None
    return restore_each(store, lambda record: _restore(sched, record))


def restore_each(store: AgentStore, restore: Callable[[AgentRecord], None]) -> tuple[int, list[StateProblem]]:
    """``restore`` every record of ``store``: how many came back, and each record that could not (unreadable, or
    ``restore`` raised) as a :class:`StateProblem`, logged (what an agent service reports as ``state_restored``
    and ``state_problems``)."""
    records, problems = store.load()
    restored = 0
    for record in records:
        try:
            restore(record)
        except (KvrtError, OSError) as exc:
            problems.append(StateProblem(record.agent_id, getattr(exc, "file", record.manifest_name), str(exc)))
        else:
            restored += 1
    for problem in problems:
        log.warning("saved agent %r not restored (%s): %s", problem.agent_id, problem.file, problem.reason)
    if problems:
        log.warning("restored %d agent(s) from %s; NOT restored: %d (%s)", restored, store.directory,
                    len(problems), ", ".join(sorted({p.agent_id for p in problems})))
    else:
        log.info("restored %d agent(s) from %s, every saved agent", restored, store.directory)
    return restored, problems


def record_policy(record: AgentRecord) -> ContextPolicy:
    """The context policy a saved agent was registered with; :class:`StateFileError` naming the file if invalid."""
    try:
        return ContextPolicy(**record.policy)  # type: ignore[arg-type]
    except (TypeError, KvrtError) as exc:
        raise StateFileError(record.manifest_name, f"{record.manifest_name}: invalid context policy "
                                                   f"{record.policy!r}: {exc}") from None


def check_model(record: AgentRecord, model: Model) -> None:
    """:class:`StateFileError` when ``model`` (the one now at the record's path) is not the one the agent was saved
    with (the socket front's agents and the HTTP front's alike)."""
    mismatch = record.fingerprint.mismatch(model.fingerprint)
    if mismatch is not None:
        raise StateFileError(record.manifest_name, f"model {record.model_path} is not the one agent "
                                                   f"{record.agent_id!r} was saved with: {mismatch}")


def _restore(sched: SchedulerView, record: AgentRecord) -> None:
    """One saved agent back in, swapped out (its KV in host memory); nothing is kept when any check fails."""
    store = sched.store
    assert store is not None
    check_agent_id(record.agent_id)
    if len(record.transcript) - record.n_tokens > 1:
        raise StateFileError(record.manifest_name, f"agent {record.agent_id!r} was saved without its KV state "
                                                   "(by a batched scheduler): serve this state dir with --batch-slots")
    agent = admit(sched, record.agent_id, record.model_path, record_policy(record), record.n_ctx)
    try:
        check_model(record, agent.entry.model)
        agent.kv.snapshot = store.load_snapshot(record, sched.pool)
    except BaseException:
        sched.registry.release(agent.entry)
        raise
    agent.transcript, agent.kv_tokens, agent.keep = list(record.transcript), record.n_tokens, record.keep
    agent.served_tokens, agent.persisted = record.served_tokens, True
    sched.add(agent)
