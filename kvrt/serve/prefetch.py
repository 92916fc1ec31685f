"""Prefetched swap-ins for the per-agent scheduler: the next agent's state moves in while another agent decodes.

When the scheduler starts a turn it knows from its queues which agent runs next. If that
agent is swapped out, :meth:`Prefetcher.stage` restores its snapshot into a staging
context of a :class:`kvrt.state.staging.KVStager` (one stager per model and context
size) on the stager's copy-in thread, overlapping the running turn. When the ledger has
no room for a staging context, the least recently used live agent of the same model and
size (never the running one) is evicted now: its context is adopted by the stager,
captured on the copy-out thread, and staged into once empty. :meth:`Prefetcher.take`
hands the staged context with its ledger charge to the agent: from then on it is the
agent's own context, made with the parameters a synchronous restore uses and filled by
the same llama.cpp restore, so the agent continues token for token as it would have.

Invariants (every method runs on the scheduler's worker thread):

* contexts are created on the worker only (``KVStager.warm``); the copy threads restore
  and capture, each into a context nobody else touches meanwhile;
* :meth:`settle` ends every scheduler job: no capture is in flight between two jobs, an
  evicted agent then holds its snapshot (or, if the capture failed, its context again),
  and stagers hold charges only for staged agents (idle staging contexts are closed);
* a prefetch decides nothing: a refusal or failure leaves the agent's snapshot where it
  was and its turn restores synchronously (``fallbacks`` counts them);
* an agent that is unstaged (cancelled, unregistered, its turn needs another context
  size, its room needed by another agent) gives its staging context and charge back only
  after the copy stopped reading its snapshot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvrt.accounting.ledger import LedgerDenied
from kvrt.engine.context import Context
from kvrt.errors import KvrtError
from kvrt.serve.agent import Agent
from kvrt.serve.registry import LoadedModel
from kvrt.serve.residency import Residency, Switch
from kvrt.state.sized_context import ChargedContext
from kvrt.state.staging import KVStager, PendingSnapshot, PrefetchHandle, StagingError

log = logging.getLogger("kvrt.serve.prefetch")
STAGING_CONTEXTS = 2  # per model and size: the next agent's and the one draining (KVStager's least)


@dataclass
class _Drain:
    """An agent evicted early: its context adopted by ``stager`` and being captured on the copy-out thread."""

    agent: Agent
    stager: KVStager
    ctx: Context
    pending: PendingSnapshot
    staged_for: str  # the agent whose prefetch evicted it


@dataclass
class PrefetchCounts:
    """What the prefetcher did since the scheduler started."""

    staged: int = 0  # prefetches started
    activations: int = 0  # turns whose agent took a staged context
    fallbacks: int = 0  # prefetches refused, failed or unstaged: those turns restored synchronously
    early_evictions: int = 0  # agents swapped out on the copy-out thread to make room for a prefetch


class Prefetcher:
    """The stagers of one scheduler's :class:`~kvrt.serve.residency.Residency` (see the module docstring)."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        self._stagers: dict[tuple[int, int], KVStager] = {}  # (id(entry), n_ctx) -> its stager
        self._drains: list[_Drain] = []
        self._evicted_for: dict[str, list[str]] = {}  # agent -> the agents swapped out early for its next turn
        self.counts = PrefetchCounts()

    @property
    def held_bytes(self) -> int:
        """What every staging context held now is charged (all of it can be given back: :meth:`reclaim`)."""
        return sum(stager.held_bytes for stager in self._stagers.values())

    def _stager(self, agent: Agent) -> KVStager:
        key = (id(agent.entry), agent.n_ctx)
        stager = self._stagers.get(key)
        if stager is None:
            res = self.residency
            stager = KVStager(agent.entry.model, agent.kv.params_for(agent.n_ctx), res.ledger,
                              max_contexts=STAGING_CONTEXTS,
                              context_bytes=agent.context_bytes, host_pool=res.pool,
                              name=f"{agent.entry.path.name}@{agent.n_ctx}")
            self._stagers[key] = stager
        return stager

    # staging --------------------------------------------------------------------------------
    def stage(self, agent: Agent, running: Agent) -> None:
        """Start moving swapped-out ``agent`` (to run after ``running``) into a staging context; may refuse."""
        if agent is running or agent.context is not None or agent.snapshot is None or agent.staged is not None:
            return
        stager = self._stager(agent)
        try:
            self._make_room(stager, agent, running)
            agent.staged = stager.prefetch(agent.snapshot)
        except KvrtError as exc:
            self.counts.fallbacks += 1
            log.debug("agent %r not prefetched, its turn restores synchronously: %s", agent.agent_id, exc)
            return
        self.counts.staged += 1

    def _make_room(self, stager: KVStager, agent: Agent, running: Agent) -> None:
        """A free staging context made on this thread, or a live agent of the same shape draining for one."""
        states = stager.states()
        if states.get("free", 0):
            return
        held = sum(states.values())
        if held < stager.max_contexts:
            try:
                stager.warm(held + 1)
                return
            except LedgerDenied:
                pass
        live = [a for a in self.residency.agents.values()
                if a.context is not None and a is not running and a.entry is agent.entry and a.n_ctx == agent.n_ctx
                and a.kv_tokens > 0 and a.kv.live is not None and a.kv.live.charge is not None]
        victim = min(live, key=lambda a: a.last_used, default=None)
        if victim is None:
            raise StagingError(f"no room for a staging context of {stager.name} and no live agent of that shape "
                               "to swap out ahead")
        victim.check()
        detached = victim.kv.detach()
        assert detached.charge is not None
        stager.adopt(detached.ctx, detached.charge)
        pending = stager.swap_out_async(detached.ctx, tokens=victim.transcript[:victim.kv_tokens])
        victim.draining = pending
        self._drains.append(_Drain(victim, stager, detached.ctx, pending, agent.agent_id))

    def take(self, agent: Agent, switch: Switch) -> bool:
        """Make ``agent`` live in its staged context (with its charge); False: it is not staged, or the copy failed."""
        switch.evicted += self._evicted_for.pop(agent.agent_id, [])  # they made room for this turn, staged or not
        handle, agent.staged = agent.staged, None
        if handle is None:
            return False
        stager = handle.stager
        if stager is not self._stagers.get((id(agent.entry), agent.n_ctx)):  # the turn needs another size
            self._unstage(handle)
            self.counts.fallbacks += 1
            return False
        try:
            staged = stager.activate(handle)
        except Exception as exc:  # noqa: BLE001 -- any failed copy falls back to the synchronous restore
            log.warning("agent %r: its prefetch failed, restoring synchronously: %s", agent.agent_id, exc)
            stager.trim()
            self.counts.fallbacks += 1
            return False
        agent.kv.adopt(ChargedContext(*stager.detach(staged), 0.0))
        record, snapshot = handle.record, agent.kv.snapshot
        assert record is not None and snapshot is not None
        switch.restored = True
        switch.in_bytes += record.nbytes
        switch.in_ms += record.exposed_ms
        agent.kv.snapshot = None  # the staged context holds the history now
        snapshot.release()
        self.counts.activations += 1
        return True

    # giving back ----------------------------------------------------------------------------
    def settle(self) -> None:
        """End of a job: every early eviction's capture done and its agent swapped out (or live again), idle
        staging contexts closed, agents staged for no queued turn unstaged."""
        drains, self._drains = self._drains, []
        for drain in drains:
            victim = drain.agent
            victim.draining = None
            try:
                victim.kv.snapshot = drain.pending.result()
            except StagingError as exc:  # the capture failed: the agent is still in its context, take it back
                victim.kv.adopt(ChargedContext(*drain.stager.detach(drain.ctx), 0.0))
                log.warning("agent %r: early swap-out failed, it stays live: %s", victim.agent_id, exc)
                continue
            self.counts.early_evictions += 1
            self._evicted_for.setdefault(drain.staged_for, []).append(victim.agent_id)
            self.residency.on_evict(victim)
        for agent in self.residency.agents.values():
            if agent.staged is not None and not agent.queue:
                self.drop(agent)
        for stager in self._stagers.values():
            stager.trim()

    def drop(self, agent: Agent) -> None:
        """Unstage ``agent``: its staging context and charge go back once its copy stopped reading the snapshot."""
        handle, agent.staged = agent.staged, None
        self._evicted_for.pop(agent.agent_id, None)
        if handle is not None:
            self._unstage(handle)
            self.counts.fallbacks += 1

    @staticmethod
    def _unstage(handle: PrefetchHandle) -> None:
        handle.cancel()
        handle.settle()
        handle.stager.trim()

    def reclaim(self, keep: Agent) -> bool:
        """Unstage every agent but ``keep`` and close idle staging contexts; True when a charge went back."""
        before = self.held_bytes
        for agent in self.residency.agents.values():
            if agent is not keep and agent.staged is not None:
                self.drop(agent)
        for stager in self._stagers.values():
            stager.trim()
        return self.held_bytes < before

    def forget(self, entry: LoadedModel) -> None:
        """Close the stagers of a model no agent uses any more (before the model is released)."""
        for key in [k for k in self._stagers if k[0] == id(entry)]:
            self._stagers.pop(key).close()

    def close(self) -> None:
        """Close every stager (staged prefetches are cancelled; the agents keep their snapshots)."""
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()
