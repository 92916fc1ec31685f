"""Prometheus metrics of kvrt's HTTP server, in a registry of its own (several servers never collide).

Counted as requests finish: requests by route (the route's template, ``other`` for a
path no route serves) and status class; prompt and completion tokens, time to the first
token and between tokens of one choice, by model, as the HTTP front saw the tokens arrive.
Read from each engine at scrape time: waiting and running requests, KV cells used and
held, prompt tokens reused from the prefix cache and prefilled, and the KV layout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from kvrt.runtime.requests import RequestEnd

if TYPE_CHECKING:
    from kvrt.runtime.batching import Engine

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class RequestRecord:
    """What one HTTP request did, filled in by its route as it runs and read when it is answered."""

    started: float = field(default_factory=time.monotonic)
    model: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between consecutive tokens of one choice
    _last: dict[int, float] = field(default_factory=dict)
    releases: list[Callable[[], None]] = field(default_factory=list)  # model holds, let go as the answer ends

    def token(self, index: int) -> None:
        """Choice ``index`` produced a token now."""
        now = time.monotonic()
        if self.ttft_s is None:
            self.ttft_s = now - self.started
        if index in self._last:
            self.gaps_s.append(now - self._last[index])
        self._last[index] = now

    def end(self, event: RequestEnd) -> None:
        """The request is over: its token counts."""
        self.prompt_tokens, self.completion_tokens = event.prompt_tokens, event.completion_tokens


class _EngineCollector(Collector):
    """Each engine's state, read from :meth:`Engine.stats` when Prometheus scrapes."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
        queued = GaugeMetricFamily("kvrt_queued_requests", "requests waiting for a slot", labels=["model"])
        active = GaugeMetricFamily("kvrt_active_requests", "requests being decoded", labels=["model"])
        used = GaugeMetricFamily("kvrt_kv_cells_used", "KV cells holding tokens", labels=["model"])
        cells = GaugeMetricFamily("kvrt_kv_cells", "KV cells of the model's context", labels=["model"])
        reused = CounterMetricFamily("kvrt_prefix_reused_tokens", "prompt tokens taken from the prefix cache",
                                     labels=["model"])
        prefilled = CounterMetricFamily("kvrt_prefilled_tokens", "prompt tokens computed", labels=["model"])
        layout = InfoMetricFamily("kvrt_kv_layout", "the context's KV layout now (split or unified)",
                                  labels=["model"])
        for name, engine in self._engines.items():
            stats = engine.stats()
            queued.add_metric([name], stats.queued)
            active.add_metric([name], stats.active)
            used.add_metric([name], stats.used_cells)
            cells.add_metric([name], stats.n_cells)
            reused.add_metric([name], stats.reused_tokens)
            prefilled.add_metric([name], stats.prefilled_tokens)
            layout.add_metric([name], {"layout": stats.kv_layout})
        yield from (queued, active, used, cells, reused, prefilled, layout)


class ServerMetrics:
    """The server's counters and histograms plus its engines' state, rendered by :meth:`render`."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter("kvrt_http_requests", "HTTP requests answered", ["route", "status"],
                                 registry=self.registry)
        self._prompt = Counter("kvrt_prompt_tokens", "prompt tokens of finished requests", ["model"],
                               registry=self.registry)
        self._completion = Counter("kvrt_completion_tokens", "tokens generated", ["model"], registry=self.registry)
        self._ttft = Histogram("kvrt_time_to_first_token_seconds", "from the request's arrival to its first token",
                               ["model"], buckets=TTFT_BUCKETS_S, registry=self.registry)
        self._itl = Histogram("kvrt_inter_token_latency_seconds", "between consecutive tokens of one choice",
                              ["model"], buckets=ITL_BUCKETS_S, registry=self.registry)
        self.registry.register(_EngineCollector(engines))

    def request_done(self, route: str, status: int, record: RequestRecord) -> None:
        """Count one answered request and what it generated."""
        self._requests.labels(route, f"{status // 100}xx").inc()
        if record.model is None:
            return
        self._prompt.labels(record.model).inc(record.prompt_tokens)
        self._completion.labels(record.model).inc(record.completion_tokens)
        if record.ttft_s is not None:
            self._ttft.labels(record.model).observe(record.ttft_s)
        itl = self._itl.labels(record.model)
        for gap in record.gaps_s:
            itl.observe(gap)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
