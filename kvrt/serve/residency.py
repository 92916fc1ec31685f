"""Which agents' contexts are live on the device: activation, growth, eviction and KV swap.

An agent runs in a live context charged to the ledger. When its context does not fit,
the least recently used live agent is swapped out: its sequence state is captured into
the (pinned) host pool with :class:`kvrt.state.snapshot.Snapshot` and its context freed
or, when the incoming agent has the same model and size, handed over as it is (creating
a context costs about as much as the restore). A growing agent moves its state into a
larger context the same way; a refused growth leaves it swapped out at its old size. All
of it runs on the scheduler's worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrt.accounting.estimate import DeviceMeter, context_estimate
from kvrt.accounting.ledger import LedgerDenied, VramLedger
from kvrt.engine.context import ContextParams
from kvrt.serve.agent import Agent
from kvrt.state.hostpool import HostPool
from kvrt.state.sized_context import ChargedContext
from kvrt.state.snapshot import Snapshot

if TYPE_CHECKING:
    from kvrt.serve.prefetch import Prefetcher


@dataclass
class Switch:
    """What making an agent runnable cost (filled while activating it)."""

    evicted: list[str] = field(default_factory=list)
    restored: bool = False
    out_bytes: int = 0
    out_ms: float = 0.0
    in_bytes: int = 0
    in_ms: float = 0.0
    context_ms: float = 0.0


class Residency:
    """The live contexts of ``agents`` (shared with the scheduler), within ``ledger``.

    ``on_evict(agent)`` runs after an agent was swapped out to make room (the scheduler
    saves it to its state dir there). With a ``prefetcher`` an agent staged ahead of its
    turn takes its staged context, and staging contexts are given back before a
    context is refused.
    """

    def __init__(self, ledger: VramLedger, agents: dict[str, Agent], *, pool: HostPool | None, n_ubatch: int,
                 n_threads: int | None, flash_attn: str, on_evict: Callable[[Agent], None]) -> None:
        self.ledger = ledger
        self.agents = agents
        self.pool = pool
        self.n_ubatch = n_ubatch
        self.n_threads = n_threads
        self.flash_attn = flash_attn
        self.on_evict = on_evict
        self.prefetcher: Prefetcher | None = None

    def prepare(self, agent: Agent, size: int, switch: Switch) -> None:
        """Make ``agent`` live in a context of at least ``size`` cells (growing moves its state; a
        refused growth leaves it swapped out at its old size, its state kept)."""
        if agent.context is not None and agent.n_ctx >= size:
            return
        if agent.context is not None:  # grow: move the state out, then into a larger context
            self.swap_out(agent, switch, record=False)
            self.free(agent)
        old = agent.n_ctx, agent.context_bytes
        if size != agent.n_ctx:
            agent.n_ctx, agent.context_bytes = size, self.estimate(agent, size)
        try:
            self.activate(agent, switch)
        except BaseException:
            if agent.context is None:
                agent.n_ctx, agent.context_bytes = old
            raise
        agent.check()

    def estimate(self, agent: Agent, n_ctx: int) -> int:
        return context_estimate(agent.entry.shape, n_ctx, self.n_ubatch).total_bytes

    def activate(self, agent: Agent, switch: Switch) -> None:
        """Give ``agent`` a live context holding its history, evicting LRU agents as needed."""
        if agent.context is not None:
            return
        agent.persisted = False  # it is about to change: the saved state stops being current
        if self.prefetcher is not None and self.prefetcher.take(agent, switch):
            return
        owner = f"agent:{agent.agent_id}"
        while agent.context is None:
            meter = DeviceMeter()
            try:
                live = ChargedContext.open(agent.entry.model, self.params(agent.n_ctx), self.ledger,
                                           agent.context_bytes, owner)
            except LedgerDenied:
                victim = self._lru_victim(agent)
                if victim is None:
                    if self.prefetcher is not None and self.prefetcher.reclaim(agent):
                        continue
                    raise
                self.swap_out(victim, switch)
                if self._compatible(victim, agent):  # hand the live context over instead of re-creating it
                    agent.live, victim.live = victim.live, None
                    assert agent.live is not None and agent.live.charge is not None  # a live context is charged
                    self.ledger.transfer(agent.live.charge, owner)
                    agent.context_bytes = agent.live.charge.nbytes  # the handed-over charge, measured or not
                else:
                    self.free(victim)
                continue
            agent.live = live
            switch.context_ms = live.create_s * 1e3
            self._correct(agent, meter.delta())
        if agent.snapshot is not None:
            t0 = time.perf_counter()
            try:
                agent.snapshot.restore(agent.context, 0)
            except BaseException:
                self.free(agent)  # the history stays in the snapshot for the next attempt
                raise
            switch.in_ms += (time.perf_counter() - t0) * 1e3
            switch.in_bytes += agent.snapshot.nbytes
            switch.restored = True
            agent.snapshot.release()
            agent.snapshot = None
        else:
            agent.context.clear()

    def _correct(self, agent: Agent, measured: int | None) -> None:
        """Replace the derived context estimate with what creating it took, where measurable."""
        if measured is None or agent.live is None or agent.live.charge is None:
            return
        try:
            self.ledger.resize(agent.live.charge, measured)
            agent.context_bytes = measured
        except LedgerDenied:
            pass  # more than estimated and the rest is taken: keep the estimate; STATUS drift shows it

    def params(self, n_ctx: int) -> ContextParams:
        batch = min(self.n_ubatch, n_ctx)
        return ContextParams(n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, n_threads=self.n_threads,
                             flash_attn=self.flash_attn)

    @staticmethod
    def _compatible(victim: Agent, agent: Agent) -> bool:
        return victim.context is not None and victim.entry is agent.entry and victim.n_ctx == agent.n_ctx

    def _lru_victim(self, agent: Agent) -> Agent | None:
        """The least recently used live agent, preferring one whose context ``agent`` can take over."""
        live = [a for a in self.agents.values() if a.context is not None and a is not agent]
        compatible = [a for a in live if self._compatible(a, agent)]
        return min(compatible or live, key=lambda a: a.last_used, default=None)

    def swap_out(self, victim: Agent, switch: Switch, *, record: bool = True) -> None:
        """Capture the victim's KV into the host pool and empty its sequence."""
        assert victim.context is not None
        victim.check()
        if victim.kv_tokens > 0:
            t0 = time.perf_counter()
            victim.snapshot = Snapshot.capture(victim.context, 0, tier="host", pool=self.pool,
                                               tokens=victim.transcript[:victim.kv_tokens])
            switch.out_ms += (time.perf_counter() - t0) * 1e3
            switch.out_bytes += victim.snapshot.nbytes
            victim.context.clear()
        if record:
            self.on_evict(victim)
            switch.evicted.append(victim.agent_id)

    def free(self, agent: Agent) -> None:
        """Close the agent's live context and give its charge back (its history stays in its snapshot, if any)."""
        if agent.live is not None:
            live, agent.live = agent.live, None
            live.close(self.ledger)
