"""One Ray Serve replica: a kvrt HTTP server in the replica's process, and the relay into it.

The replica starts exactly what ``kvrt serve --http`` starts (:func:`kvrt.serve.http_front.start_front`: its
own ledger, model registry and one engine per model) on a loopback port of its node, and :meth:`KvrtReplica.forward`
relays a request to it over HTTP and yields the answer back as it comes: first its :class:`Head`, then the body's
bytes as the server writes them (an SSE stream event by event). So a replica answers every route, error and
stream exactly as a single server does. Each answer carries the replica's id in ``X-Kvrt-Replica``.

A relayed request that is abandoned (the client went away, so Ray cancels this generator) closes its connection
to the server, which cancels the request in the engine, as a single server's client disconnecting does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import aiohttp
from ray import serve

from kvrt.accounting.budget import choose_budget
from kvrt.accounting.ledger import VramLedger
from kvrt.cluster.affinity import Route
from kvrt.errors import KvrtError
from kvrt.runtime.admission import EngineConfig
from kvrt.serve.http_front import HttpOptions, start_front
from kvrt.serve.registry import ModelRegistry

REPLICA_HEADER = "X-Kvrt-Replica"
RECONCILE_S = 5.0  # kvrt serve --reconcile-s's default: how often a GPU's ledger re-reads NVML
# never copied across the relay: hop-by-hop headers, those the relay's client recomputes, and those the outer
# server (Serve's proxy) writes itself (``date``, ``server``: else an answer carries two of each)
NOT_RELAYED = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
                         "te", "trailer", "proxy-connection", "date", "server"})


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica serves: the HTTP front's options and engine config (``kvrt serve --http``'s), and its
    ledger's cap (``capacity_bytes`` None: ``admit_percent`` of the GPU's memory, else a share of host RAM, as
    ``kvrt serve`` decides) and the layers it offloads."""

    http: HttpOptions = field(default_factory=HttpOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    capacity_bytes: int | None = None
    admit_percent: float = 90.0
    n_gpu_layers: int = -1


@dataclass(frozen=True)
class Head:
    """An answer's status and headers: the first item :meth:`KvrtReplica.forward` yields."""

    status: int
    headers: tuple[tuple[str, str], ...]

    @property
    def streamed(self) -> bool:
        """An SSE stream, passed on as it comes (anything else is one body)."""
        return any(name.lower() == "content-type" and value.startswith("text/event-stream")
                   for name, value in self.headers)


def relayed(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` without the ones a relay must not copy."""
    return [(name, value) for name, value in headers if name.lower() not in NOT_RELAYED]


class KvrtReplica:
    """A kvrt HTTP server in this process (see the module docstring); Ray Serve creates one per replica."""

    def __init__(self, spec: ReplicaSpec) -> None:
        budget = choose_budget(spec.capacity_bytes, spec.admit_percent)
        self._ledger = VramLedger(budget.capacity_bytes, admit_percent=spec.admit_percent,
                                  reconcile_every_s=RECONCILE_S if budget.source == "nvml" else None)
        self._registry = ModelRegistry(self._ledger, n_gpu_layers=spec.n_gpu_layers)
        try:
            self._front = start_front(spec.http, spec.engine, self._registry, "127.0.0.1", 0)
        except BaseException:
            self._registry.close()
            self._ledger.close()
            raise
        host, port = self._front.address
        self._base = f"http://{host}:{port}"
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        self._closed = False

    async def forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes, *,
                      route: Route) -> AsyncIterator[Head | bytes]:
        """Relay one request (``path`` with its query) to this replica's server: its :class:`Head`, then its body
        as it comes. ``route`` is read by the router that chose this replica (:mod:`kvrt.cluster.router`)."""
        del route
        # a client per request: nothing outlives the request on the loop (a loopback connect costs ~0.1 ms)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False) as client, \
                client.request(method, self._base + path, headers=relayed(headers), data=body) as answer:
            try:
                yield Head(answer.status, (*relayed(answer.headers.items()), (REPLICA_HEADER, self.replica_id)))
                async for chunk in answer.content.iter_any():
                    yield chunk
            except BaseException:
                answer.close()  # abandoned midway: drop the connection, so the server cancels the request
                raise

    async def check_health(self) -> None:
        """Ray Serve's health check: the server answers ``/health`` with 200 (else Ray restarts this replica)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client, \
                client.get(self._base + "/health") as answer:
            if answer.status != 200:
                raise KvrtError(f"replica {self.replica_id}: /health answered {answer.status}")

    def __del__(self) -> None:
        """Ray Serve's shutdown: end open requests, stop the server, free the engines, models and ledger (once:
        Ray calls this, then the object's collection may too)."""
        if getattr(self, "_closed", True):  # closed, or __init__ failed (and freed what it took)
            return
        self._closed = True
        self._front.close()
        self._registry.close()
        self._ledger.close()
