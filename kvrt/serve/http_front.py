"""The HTTP front's start-up: models, engines, agents and the OpenAI server, from typed options.

``kvrt serve --http`` (:mod:`kvrt.commands._http`) turns its command line into :class:`HttpOptions` and an
:class:`kvrt.runtime.admission.EngineConfig` and calls :func:`start_front`; a cluster replica
(:mod:`kvrt.cluster.replica`) calls the same function, so a replica serves exactly what the command serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvrt.errors import KvrtError
from kvrt.modelfiles.demo_model import demo_model_path
from kvrt.runtime.admission import EngineConfig
from kvrt.serve.http_agents import AgentBook
from kvrt.serve.http_intake import DEFAULT_MAX_INPUT_BYTES
from kvrt.serve.http_runner import DEFAULT_SSE_KEEPALIVE_S
from kvrt.serve.model_pool import ModelPool
from kvrt.serve.openai_server import OpenAIServer
from kvrt.serve.registry import ModelRegistry


@dataclass(frozen=True)
class HttpOptions:
    """What the HTTP front serves and its limits (each field is the ``kvrt serve`` option of the same name).

    ``models``: GGUF files loaded at start (none and no ``models_dir``: the demo model); ``models_dir``: every
    ``*.gguf`` there, loaded on demand; ``state_dir``: agents' turns saved in ``DIR/http``; ``step_trace``: every
    engine's steps in ``DIR/MODEL.jsonl`` (:mod:`kvrt.runtime.step_trace`); ``replicas``: copies of each model, one
    a device of the registry's device set (:class:`kvrt.serve.model_pool.ModelPool`)."""

    models: tuple[Path, ...] = ()
    models_dir: Path | None = None
    state_dir: Path | None = None
    max_tokens: int = 512
    request_timeout_s: float | None = None
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    api_key: str | None = None
    sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S
    exact_prefix: bool = False
    context_policy: str = "refuse"
    keep_tokens: int = 1
    step_trace: Path | None = None
    replicas: int = 1


@dataclass
class HttpFront:
    """A started HTTP server and its model pool: an engine per loaded model, each model leased from the process's
    :class:`ModelRegistry` (shared with the socket front's agents on the same file) and each engine's context
    charged to the ledger. :meth:`close` stops it and gives all of that back."""

    server: OpenAIServer
    address: tuple[str, int]
    pool: ModelPool

    def close(self) -> None:
        """Stop accepting, end open requests (streams get their final event and [DONE]), then free everything."""
        self.server.stop_accepting()
        self.pool.close_engines()
        self.server.stop()
        self.pool.close()


def start_front(options: HttpOptions, config: EngineConfig, registry: ModelRegistry, host: str,
                port: int) -> HttpFront:
    """Load every model of ``options`` through ``registry`` (admitted by its ledger, or refused with the ledger's
    numbers before its weights are read), charge one engine's context (``config``) each, list ``models_dir``'s
    models for loading on demand, and serve them on ``host:port`` (0: any free port) from a background thread."""
    paths = list(options.models) or ([] if options.models_dir else [demo_model_path()])
    names = [p.stem for p in paths]
    if len(set(names)) != len(names):
        raise KvrtError(f"two models would share a name (the file stem): {names}")
    agents = AgentBook(options.state_dir)  # a state dir another process holds: refused before loading
    try:
        pool = ModelPool(registry, config, models=dict(zip(names, paths)), models_dir=options.models_dir,
                         step_trace_dir=options.step_trace, replicas=options.replicas)
    except BaseException:
        agents.close()  # a refused option lets the state dir go again
        raise
    try:
        if not pool.names():
            raise KvrtError(f"--models-dir {options.models_dir}: no *.gguf files there, and no --model given")
        for name in names:
            pool.preload(name)
        agents.verify(pool.paths(), pool.engines)
        agents.prefetch(pool.engines)  # saved agents of the models loaded now: from disk into host memory
        server = OpenAIServer(pool, default_max_tokens=options.max_tokens,
                              request_timeout_s=options.request_timeout_s, max_input_bytes=options.max_input_bytes,
                              api_key=options.api_key, sse_keepalive_s=options.sse_keepalive_s,
                              exact_prefix=options.exact_prefix, context_policy=options.context_policy,
                              keep_tokens=options.keep_tokens, agents=agents)
        address = server.start(host, port)  # an address it cannot listen on: KvrtError, one line
    except BaseException:
        pool.close()
        agents.close()
        raise
    return HttpFront(server, address, pool)
