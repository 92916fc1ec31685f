"""What the scheduler hands the daemon and library callers: refusals and typed results.

Everything crossing the scheduler's boundary is one of these dataclasses (never a dict
indexed by string); :mod:`kvrt.serve.protocol` turns them and the errors into lines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvrt.errors import InvalidArgument, KvrtError

AGENT_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-:@")
MAX_AGENT_ID = 64


class SchedulerError(KvrtError):
    """A scheduler request was refused; ``code`` is its protocol error code."""

    code = "SCHEDULER"


class UnknownAgent(SchedulerError):
    code = "UNKNOWN_AGENT"


class AgentExists(SchedulerError):
    code = "AGENT_EXISTS"


class SchedulerClosed(SchedulerError):
    code = "SHUTTING_DOWN"


class ContextFull(SchedulerError):
    """A turn does not fit the agent's context under its policy; the agent is unchanged."""

    code = "CONTEXT_FULL"


def check_agent_id(agent_id: str) -> str:
    if not isinstance(agent_id, str) or not 0 < len(agent_id) <= MAX_AGENT_ID or not set(agent_id) <= AGENT_ID_CHARS:
        raise InvalidArgument(f"agent id must be 1..{MAX_AGENT_ID} characters of [A-Za-z0-9_.:@-], got {agent_id!r}")
    return agent_id


@dataclass(frozen=True)
class Percentiles:
    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0


def percentiles(values: list[float]) -> Percentiles:
    """p50/p95/p99 (linear interpolation); zeros for no data."""
    if not values:
        return Percentiles()
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99])
    return Percentiles(float(p50), float(p95), float(p99))


@dataclass(frozen=True)
class RequestMetrics:
    """What one request cost, by phase (milliseconds and bytes)."""

    agent_id: str
    queue_wait_ms: float
    swap_out_bytes: int
    swap_out_ms: float
    swap_in_bytes: int
    swap_in_ms: float
    context_ms: float
    decode_ms: float
    latency_ms: float
    prompt_tokens: int
    generated_tokens: int
    shifted_tokens: int = 0  # dropped from the history by the shift policy before this turn
    first_token_ms: float = 0.0  # from submission to the first sampled token


@dataclass(frozen=True)
class DecodeResult:
    """A finished request: its text and what switching to its agent cost.

    ``unsaved``: why the agent's state after this turn could not be saved to the state dir
    (a restart would lose the turn), or None: saved, or no state dir.
    """

    agent_id: str
    text: str
    tokens: list[int]
    finish_reason: str
    evicted: tuple[str, ...]
    restored: bool
    metrics: RequestMetrics
    unsaved: str | None = None


def ended_early(agent_id: str, reason: str, waited_ms: float) -> DecodeResult:
    """The result of a request that ended before it ran (``cancelled`` or ``deadline``): no tokens."""
    metrics = RequestMetrics(agent_id, waited_ms, 0, 0.0, 0, 0.0, 0.0, 0.0, waited_ms, 0, 0)
    return DecodeResult(agent_id, "", [], reason, (), False, metrics)


@dataclass(frozen=True)
class AgentInfo:
    """One agent as LIST shows it."""

    agent_id: str
    model: str
    n_ctx: int  # cells of its context now (a growing agent's current size)
    max_ctx: int
    policy: str
    state: str  # active, swapped or cold
    context_bytes: int
    queued: int
    requests: int
    served_tokens: int
    held_tokens: int


@dataclass(frozen=True)
class Registered:
    agent_id: str
    model: str
    n_ctx: int
    max_ctx: int
    policy: str
    weights_bytes: int
    context_bytes: int
    estimate: str


@dataclass(frozen=True)
class Forked:
    agent_id: str
    source: str
    held_tokens: int


@dataclass(frozen=True)
class MetricsSummary:
    """Totals and latency percentiles (ms) over the scheduler's recent requests."""

    requests: int
    generated_tokens: int
    swap_outs: int
    swap_ins: int
    swap_out_bytes: int
    swap_in_bytes: int
    latency_ms: Percentiles
    queue_wait_ms: Percentiles
    swap_in_ms: Percentiles
    decode_ms: Percentiles
    first_token_ms: Percentiles

    @classmethod
    def of(cls, rows: list[RequestMetrics]) -> MetricsSummary:
        return cls(
            requests=len(rows),
            generated_tokens=sum(m.generated_tokens for m in rows),
            swap_outs=sum(1 for m in rows if m.swap_out_bytes),
            swap_ins=sum(1 for m in rows if m.swap_in_bytes),
            swap_out_bytes=sum(m.swap_out_bytes for m in rows),
            swap_in_bytes=sum(m.swap_in_bytes for m in rows),
            latency_ms=percentiles([m.latency_ms for m in rows]),
            queue_wait_ms=percentiles([m.queue_wait_ms for m in rows]),
            swap_in_ms=percentiles([m.swap_in_ms for m in rows if m.swap_in_bytes]),
            decode_ms=percentiles([m.decode_ms for m in rows]),
            first_token_ms=percentiles([m.first_token_ms for m in rows]),
        )
