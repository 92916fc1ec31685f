"""FORK in the per-agent scheduler: a new agent whose history starts as a copy of another's.

The fork gets the source's whole current state: its transcript, and the KV of
``transcript[:kv_tokens]`` captured from the source's live context (a swapped-out source
is made live first, the usual swap-in). A longest-prefix cache
(:class:`kvrt.state.snapshot_cache.SnapshotCache`) has nothing to add here: the source's
exact state is always at hand, live or in its own snapshot, so a prefix lookup could only
find that state or a shorter one whose rest must be prefilled again (slower, and a
prefill's KV is not bit-identical to the incrementally decoded one the source holds).
"""

from __future__ import annotations

from kvrt.serve.agent import Agent
from kvrt.serve.membership import check_feasible
from kvrt.serve.residency import Switch
from kvrt.serve.results import AgentExists, Forked
from kvrt.serve.scheduler_view import SchedulerView


def fork(sched: SchedulerView, source_id: str, agent_id: str) -> Forked:
    """Admit ``agent_id`` as a copy of ``source_id`` (worker thread); a refusal changes nothing."""
    source = sched._agent(source_id)
    if agent_id in sched._agents:
        raise AgentExists(f"agent {agent_id!r} is already registered")
    check_feasible(sched, agent_id, source.context_bytes)
    sched.residency.activate(source, Switch())  # a swapped-out source is restored, then copied from its context
    kv = sched.residency.context_for(source.entry, agent_id, source.n_ctx)
    kv.snapshot = source.kv.capture(source.transcript[:source.kv_tokens])
    sched.registry.acquire(source.entry.path)  # one more reference; cannot be refused, it is resident
    agent = Agent(agent_id, source.entry, source.policy, kv, transcript=list(source.transcript),
                  kv_tokens=source.kv_tokens, keep=source.keep, served_tokens=source.served_tokens)
    sched.add(agent)
    return Forked(agent_id, source_id, agent.held_tokens)
