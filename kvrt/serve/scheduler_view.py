"""The per-agent scheduler as its parts see it: admission and teardown, forks, the state dir.

:mod:`kvrt.serve.membership`, :mod:`kvrt.serve.forking` and :mod:`kvrt.serve.statedir` act on
the scheduler's agents and resources, and :class:`kvrt.serve.scheduler.Scheduler` calls
them; they take it as a :class:`SchedulerView` (which it satisfies) so that only the
scheduler imports them, never the other way round. Like the scheduler's own methods they
run on its worker thread; ``_agents`` changes only under ``_cond``.
"""

from __future__ import annotations

import threading
from typing import Protocol

from kvrt.accounting.ledger import VramLedger
from kvrt.serve.agent import Agent
from kvrt.serve.prefetch import Prefetcher
from kvrt.serve.registry import ModelRegistry
from kvrt.serve.residency import Residency
from kvrt.state.agentstore import AgentStore
from kvrt.state.hostpool import HostPool


class SchedulerView(Protocol):
    """What membership, forking and the state dir use of :class:`kvrt.serve.scheduler.Scheduler`."""

    @property
    def ledger(self) -> VramLedger: ...

    @property
    def registry(self) -> ModelRegistry: ...

    @property
    def residency(self) -> Residency: ...

    @property
    def prefetcher(self) -> Prefetcher | None: ...

    @property
    def n_ubatch(self) -> int: ...

    @property
    def pool(self) -> HostPool | None: ...

    @property
    def store(self) -> AgentStore | None: ...

    @property
    def _agents(self) -> dict[str, Agent]: ...

    @property
    def _cond(self) -> threading.Condition: ...

    def _agent(self, agent_id: str) -> Agent:
        """The registered agent ``agent_id``; :class:`kvrt.serve.results.UnknownAgent` when there is none."""
        ...

    def add(self, agent: Agent) -> None:
        """Make an admitted agent schedulable."""
        ...
