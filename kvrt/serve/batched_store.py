"""The batched scheduler's agents in a state directory (:mod:`kvrt.state.agentstore`): saved as transcripts.

A batched agent's KV lives in cells of its model's shared context, beside other agents'
(and in the engine's host tier once evicted), so what outlives the process is its
registration and its exact transcript: every agent is saved when the scheduler closes
and forgotten when it is unregistered; a new scheduler on the same directory registers
them again, and each one's next turn prefills its transcript (a turn after a restart
costs a prefill; its tokens are those of the same history never stopped). A saved agent
that cannot come back (damaged file, another model now at that path) is skipped and
listed in ``state_problems``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvrt.errors import KvrtError
from kvrt.serve.statedir import check_model, record_policy, restore_each
from kvrt.state.agentstore import AgentRecord

if TYPE_CHECKING:
    from kvrt.serve.batched import BatchedScheduler, _Agent

log = logging.getLogger("kvrt.serve.batched_store")


def save_all(sched: BatchedScheduler, agents: list[_Agent]) -> None:
    """Save every agent's registration and transcript (no KV: ``n_tokens`` 0); a failure is logged, not raised."""
    store = sched.store
    assert store is not None
    for agent in agents:
        record = AgentRecord(agent.agent_id, str(agent.pool.entry.path), agent.pool.entry.model.fingerprint,
                             agent.policy.n_ctx, 0, agent.served_tokens, tuple(agent.transcript),
                             agent.policy.as_record(), agent.keep)
        try:
            store.save(record, None)
        except (KvrtError, OSError) as exc:
            log.warning("agent %r: not saved to %s: %s", agent.agent_id, store.directory, exc)


def restore_all(sched: BatchedScheduler) -> None:
    """Register every agent saved in the state dir again, with its transcript; each one that cannot is a problem."""
    restore_each(sched, lambda record: _restore(sched, record))


def _restore(sched: BatchedScheduler, record: AgentRecord) -> None:
    policy = record_policy(record)
    entry = sched.registry.acquire(record.model_path)  # checked before anything is registered; held meanwhile
    try:
        check_model(record, entry)
        sched.register(record.agent_id, record.model_path, policy.n_ctx, policy=policy.mode,
                       min_ctx=policy.min_ctx, keep=policy.keep)
    finally:
        sched.registry.release(entry)  # the agent's pool holds the model now
    agent = sched._agents[record.agent_id]
    agent.transcript, agent.keep, agent.served_tokens = list(record.transcript), record.keep, record.served_tokens
