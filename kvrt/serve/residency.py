"""Which agents' contexts are live on the device: activation, growth, eviction and KV swap.

An agent runs in a live context charged to the ledger (its
:class:`~kvrt.state.agent_context.AgentContext`: the mechanism; this module is the policy).
When its context does not fit, the least recently used live agent is swapped out: its
sequence state is captured into the (pinned) host pool and its context freed or, when the
incoming agent has the same model and size, handed over as it is (creating a context
costs about as much as the restore). A growing agent moves its state into a
larger context the same way; a refused growth leaves it swapped out at its old size. All
of it runs on the scheduler's worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvrt.accounting.estimate import DeviceMeter
from kvrt.accounting.ledger import LedgerDenied, VramLedger
from kvrt.engine.context_params import ContextParams
from kvrt.serve.agent import Agent
from kvrt.serve.registry import LoadedModel
from kvrt.state.agent_context import AgentContext
from kvrt.state.hostpool import HostPool


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


class Prefetching(Protocol):
    """What activation asks of the prefetcher (:class:`kvrt.serve.prefetch.Prefetcher`, which imports this module)."""

    def take(self, agent: Agent, switch: Switch) -> bool:
        """Make ``agent`` live in its staged context; False when it has none ready."""
        ...

    def reclaim(self, keep: Agent) -> bool:
        """Give staging contexts back (all but ``keep``'s); True when a charge went back."""
        ...


class Residency:
    """The live contexts of ``agents`` (shared with the scheduler), within ``ledger``.

    ``on_evict(agent)`` runs after an agent was swapped out to make room (the scheduler
    saves it to its state dir there). With a ``prefetcher`` an agent staged ahead of its
    turn takes its staged context, and staging contexts are given back before a
    context is refused.
    """

    def __init__(self, ledger: VramLedger, agents: dict[str, Agent], *, pool: HostPool | None, n_ubatch: int,
                 n_threads: int | None, flash_attn: str, on_evict: Callable[[Agent], object],
                 measure: bool = True) -> None:
        self.ledger = ledger
        self.measure = measure  # correct each context's estimate to the device memory it took (a GPU only)
        self.agents = agents
        self.pool = pool
        self.n_ubatch = n_ubatch
        self.n_threads = n_threads
        self.flash_attn = flash_attn
        self.on_evict = on_evict
        self.prefetcher: Prefetching | None = None

    def context_for(self, entry: LoadedModel, agent_id: str, n_ctx: int) -> AgentContext:
        """A new agent's (not yet opened) context of ``n_ctx`` cells, charged to ``agent:<id>`` once opened."""
        params = ContextParams(n_ctx=n_ctx, n_batch=self.n_ubatch, n_ubatch=self.n_ubatch, n_threads=self.n_threads,
                               flash_attn=self.flash_attn)
        return AgentContext(entry.model, entry.shape, params, self.ledger, f"agent:{agent_id}", n_ctx, pool=self.pool)

    def prepare(self, agent: Agent, size: int, switch: Switch) -> None:
        """Make ``agent`` live in a context of at least ``size`` cells (growing moves its state; a
        refused growth leaves it swapped out at its old size, its state kept)."""
        kv = agent.kv
        if kv.live is not None and kv.n_ctx >= size:
            return
        if kv.live is not None:  # grow: move the state out, then into a larger context
            self.swap_out(agent, switch, record=False)
            kv.free()
        old = kv.n_ctx, kv.nbytes
        kv.set_size(size)
        try:
            self.activate(agent, switch)
        except BaseException:
            if kv.live is None:
                kv.n_ctx, kv.nbytes = old
            raise
        agent.check()

    def activate(self, agent: Agent, switch: Switch) -> None:
        """Give ``agent`` a live context holding its history, evicting LRU agents as needed."""
        kv = agent.kv
        if kv.live is not None:
            return
        if self.prefetcher is not None and self.prefetcher.take(agent, switch):
            return
        while kv.live is None:
            meter = DeviceMeter(self.measure)
            try:
                live = kv.open()
            except LedgerDenied:
                victim = self._lru_victim(agent)
                if victim is None:
                    if self.prefetcher is not None and self.prefetcher.reclaim(agent):
                        continue
                    raise
                self.swap_out(victim, switch)
                if self._compatible(victim, agent):  # hand the live context over instead of re-creating it
                    kv.adopt(victim.kv.detach())
                else:
                    victim.kv.free()
                continue
            switch.context_ms = live.create_s * 1e3
            self._correct(kv, meter.delta())
        t0 = time.perf_counter()
        restored = kv.swap_in()  # a failure frees the context and keeps the snapshot for the next attempt
        if restored:
            switch.in_ms += (time.perf_counter() - t0) * 1e3
            switch.in_bytes += restored
            switch.restored = True

    def _correct(self, kv: AgentContext, measured: int | None) -> None:
        """Replace the derived context estimate with what creating it took, where measurable."""
        if measured is None or kv.live is None or kv.live.charge is None:
            return
        try:
            self.ledger.resize(kv.live.charge, measured)
            kv.nbytes = measured
        except LedgerDenied:
            pass  # more than estimated and the rest is taken: keep the estimate; STATUS drift shows it

    @staticmethod
    def _compatible(victim: Agent, agent: Agent) -> bool:
        return victim.context is not None and victim.entry is agent.entry and victim.n_ctx == agent.n_ctx

    def _lru_victim(self, agent: Agent) -> Agent | None:
        """The least recently used live agent, preferring one whose context ``agent`` can take over."""
        live = [a for a in self.agents.values() if a.context is not None and a is not agent]
        compatible = [a for a in live if self._compatible(a, agent)]
        return min(compatible or live, key=lambda a: a.last_used, default=None)

    def swap_out(self, victim: Agent, switch: Switch, *, record: bool = True) -> None:
        """Capture the victim's KV into the host pool and empty its sequence (its context stays live)."""
        assert victim.context is not None
        victim.check()
        if victim.kv_tokens > 0:
            t0 = time.perf_counter()
            switch.out_bytes += victim.kv.swap_out(victim.transcript[:victim.kv_tokens])
            switch.out_ms += (time.perf_counter() - t0) * 1e3
        if record:
            self.on_evict(victim)
            switch.evicted.append(victim.agent_id)
