"""The agent service the daemon drives: one interface, a per-agent and a batched implementation.

:class:`kvrt.serve.scheduler.Scheduler` gives each agent a context of its own and swaps
contexts to host memory; :class:`kvrt.serve.batched.BatchedScheduler` decodes a model's
agents as sequences of one shared context, one batch per step. The daemon, the protocol
handler and library callers see only :class:`AgentService`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generic, Self, TypeVar

from kvrt.engine.sampling import SamplingParams
from kvrt.serve.results import AgentInfo, DecodeResult, Forked, MetricsSummary, Registered, RequestMetrics, UnknownAgent

if TYPE_CHECKING:
    from kvrt.accounting.ledger import VramLedger
    from kvrt.serve.registry import ModelRegistry
    from kvrt.state.agentstore import AgentStore, StateProblem

HISTORY = 100_000
"""Request metrics an agent service keeps for its percentiles."""

TextFn = Callable[[str], None]
"""Receives a turn's reply text as it becomes available."""

AgentT = TypeVar("AgentT")


class AgentService(ABC, Generic[AgentT]):
    """Agents registered by name on models, each running its turns in order.

    Every method may be called from any thread. ``store`` is where agents outlive the
    process (``None``: they do not); ``state_problems`` and ``state_restored`` report what
    the last start found there.
    """

    ledger: VramLedger
    registry: ModelRegistry
    store: AgentStore | None
    state_problems: Sequence[StateProblem]
    state_restored: int
    _agents: dict[str, AgentT]

    @abstractmethod
    def register(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int = 4096, *,
                 policy: str = "refuse", min_ctx: int | None = None, keep: int | None = None) -> Registered:
        """Admit an agent on ``model_path`` whose history may hold ``n_ctx`` cells, under ``policy``."""

    @abstractmethod
    def unregister(self, agent_id: str) -> None:
        """Remove an agent: its queued turns fail and what it held is freed."""

    @abstractmethod
    def fork(self, source_id: str, agent_id: str) -> Forked:
        """A new agent whose history starts as a copy of ``source_id``'s."""

    @abstractmethod
    def submit(self, agent_id: str, prompt: str | Sequence[int], n_tokens: int, *,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), deadline: float | None = None,
               on_text: TextFn | None = None) -> Future[DecodeResult]:
        """Queue a turn: ``prompt`` appended to the agent's history, then up to ``n_tokens`` generated."""

    @abstractmethod
    def cancel(self, agent_id: str) -> int:
        """End the agent's queued turns (and, where the service can, its running one); returns how many."""

    @abstractmethod
    def transcript(self, agent_id: str) -> list[int]:
        """Every token of the agent's history, in order (what a recompute of it would prefill)."""

    @abstractmethod
    def agents(self) -> list[AgentInfo]:
        """One line of facts per registered agent."""

    @abstractmethod
    def metrics(self, agent_id: str | None = None) -> MetricsSummary:
        """Totals and latency percentiles over the recent turns (of one agent, or all)."""

    @abstractmethod
    def history(self) -> list[RequestMetrics]:
        """The recent turns' metrics, oldest first."""

    @abstractmethod
    def close(self, timeout: float | None = None) -> bool:
        """Stop: queued turns fail, agents are saved where there is a store, everything is freed."""

    def _agent(self, agent_id: str) -> AgentT:
        agent = self._agents.get(agent_id)
        if agent is None:
            raise UnknownAgent(f"no agent {agent_id!r} is registered")
        return agent

    def decode(self, agent_id: str, prompt: str | Sequence[int], n_tokens: int, *,
               sampling: SamplingParams | None = None, stop: Sequence[str] = ()) -> DecodeResult:
        """:meth:`submit` and wait for the result."""
        return self.submit(agent_id, prompt, n_tokens, sampling=sampling, stop=stop).result()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
