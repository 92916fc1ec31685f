"""Agents joining and leaving the per-agent scheduler: admission against the ledger, and the teardown.

Worker thread only. Admission validates before it allocates: an agent is admitted once
it is known it can ever run, that is, its model's weights plus its first context fit
with every other agent's context swapped out and every staging context given back; a
refusal changes nothing. A teardown gives back everything the agent held: its queued
turns fail, its staging context (after the copy stopped reading its snapshot), its
context and charge, its snapshot, its reference to the model.
"""

from __future__ import annotations

import os

from kvrt.accounting.estimate import context_estimate
from kvrt.accounting.ledger import LedgerDenied
from kvrt.serve.agent import Agent, ContextPolicy
from kvrt.serve.results import AgentExists, SchedulerError
from kvrt.serve.scheduler_view import SchedulerView


def admit(sched: SchedulerView, agent_id: str, model_path: str | os.PathLike[str], policy: ContextPolicy,
          n_ctx: int) -> Agent:
    """A new agent holding a reference to its (loaded) model, not yet schedulable (:meth:`Scheduler.add`)."""
    if agent_id in sched._agents:
        raise AgentExists(f"agent {agent_id!r} is already registered")
    shape, weight_bytes = sched.registry.peek(model_path)
    context_bytes = context_estimate(shape, n_ctx, sched.n_ubatch).total_bytes
    check_feasible(sched, agent_id, weight_bytes + context_bytes)
    entry = sched.registry.acquire(model_path)
    return Agent(agent_id, entry, policy, sched.residency.context_for(entry, agent_id, n_ctx))


def check_feasible(sched: SchedulerView, agent_id: str, request_bytes: int) -> None:
    """Refuse an agent that could never run: even with every context swapped out (and every staging
    context given back) ``request_bytes`` more do not fit."""
    snap = sched.ledger.snapshot()
    evictable = sum(a.context_bytes for a in sched._agents.values() if a.context is not None)
    evictable += sched.prefetcher.held_bytes if sched.prefetcher is not None else 0
    if snap.allocated_bytes - evictable + snap.external_bytes + request_bytes > snap.max_bytes:
        raise LedgerDenied(owner=f"agent:{agent_id}", max_bytes=snap.max_bytes, allocated_bytes=snap.allocated_bytes,
                           request_bytes=request_bytes, external_bytes=snap.external_bytes)


def teardown(sched: SchedulerView, agent: Agent, error: SchedulerError) -> None:
    """Free everything ``agent`` holds; its queued turns fail with ``error``."""
    while agent.queue:
        agent.queue.popleft().future.set_exception(error)
    if sched.prefetcher is not None:
        sched.prefetcher.drop(agent)  # before its snapshot goes: a staged copy may still read it
        if not any(a.entry is agent.entry for a in sched._agents.values() if a is not agent):
            sched.prefetcher.forget(agent.entry)
    agent.kv.close()
    sched.registry.release(agent.entry)
