"""kvrt's OpenAI-compatible HTTP server: the FastAPI app over one batching engine per model, and OpenAI's routes.

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/responses``
(with ``GET`` / ``DELETE /v1/responses/{id}``; see :mod:`kvrt.serve.responses_routes`) speak OpenAI's wire
format (SSE streaming with ``data: [DONE]``, ``n``, logprobs, stop, seed, penalties,
``response_format`` through the grammar sampler, usage with
``cached_tokens``; chat ``tools`` and ``tool_choice``: see :mod:`kvrt.serve.chat_prompt` and
:mod:`kvrt.serve.tool_calls`); a stream with nothing to send yet gets ``: keep-alive``
comments every ``sse_keepalive_s``; errors are ``{"error": {"message", "type", "param", "code"}}``
with 400 for bad input naming the field, 404 for an unknown model, 503 when an
engine's queue is full. kvrt's own routes live under ``/v1/kvrt/`` (:mod:`kvrt.serve.kvrt_routes`; a model's load
and unload: :mod:`kvrt.serve.model_routes`).

This module builds the app, wires its parts together and serves it; the parts are:
:mod:`kvrt.serve.http_intake` (bodies, agents, prompts' tokens), :mod:`kvrt.serve.http_runner` (requests fed to the
engines and answered), :mod:`kvrt.serve.recent` (what fork and ``previous_response_id`` name), the route modules
named above, and :mod:`kvrt.serve.http_middleware` (the API key, the request record). Every route is registered
here, in one place (:meth:`OpenAIServer._build_app`), whichever module serves it: one list names every path the app
serves (and every route template ``/metrics`` counts under).

Agents: a request names its agent by the ``X-Kvrt-Agent`` header or ``user``; its history is kept
between turns and, with a state dir, saved before each turn is answered and restored after a
restart (:mod:`kvrt.serve.http_agents`).

``POST /tokenize`` / ``POST /detokenize`` (llama-server's shapes)
    ``{"content", "add_special", "model"}`` -> ``{"tokens"}`` (special-token text parsed) and
    ``{"tokens", "model"}`` -> ``{"content"}`` (the pieces joined, special tokens' text
    included); ``model`` may be
    left out when the server has one.

``GET /metrics`` is Prometheus' text format (see :mod:`kvrt.serve.metrics`).

``GET /health`` answers 200 ``{"status": "ok", "models": {name: {"queued", "active"}}}``
while serving and 503 ``{"status": "shutting_down", ...}`` once :meth:`OpenAIServer.stop_accepting`
was called, so a load balancer stops sending before the engines close.

With ``api_key`` set every route but ``/health`` needs ``Authorization: Bearer <key>``; a
missing or wrong key gets 401 ``invalid_api_key`` before the body is read.

A client that disconnects cancels its request (its slot is freed at the next step).
A body over ``max_input_bytes`` is refused with 413 before it is read whole; a prompt
whose text cannot fit the model's cells is refused before it is tokenized; tokenizing and
chat templates run on a thread pool, never on the event loop (a long text would stall
every client).
Model names are the GGUF files' stems.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.routing import Route

from kvrt.errors import KvrtError
from kvrt.runtime.batching import Engine
from kvrt.serve.api_error import ApiError
from kvrt.serve.context_policy import check_policy
from kvrt.serve.http_agents import AgentBook
from kvrt.serve.http_intake import DEFAULT_MAX_INPUT_BYTES, Intake, request_agent
from kvrt.serve.http_middleware import Observe, RequireKey
from kvrt.serve.http_runner import DEFAULT_SSE_KEEPALIVE_S, Runner
from kvrt.serve.kvrt_routes import KvrtRoutes
from kvrt.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvrt.serve.metrics import RequestRecord, ServerMetrics
from kvrt.serve.model_pool import ModelPool
from kvrt.serve.model_routes import ModelRoutes
from kvrt.serve.openai_schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    check_vocab,
    completion_prompt,
    parse,
    pieces_text,
    single_prompt,
)
from kvrt.serve.responses_routes import ResponsesRoutes

log = logging.getLogger("kvrt.serve.http")  # one info line per answered request (kvrt -v serve shows them)
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (a load balancer's probe has none)


class OpenAIServer:
    """The HTTP front over ``engines``: a :class:`ModelPool` (models loaded on demand, unloaded when idle; the
    pool stays the caller's to close) or a mapping of model name -> engine (fixed; the engines stay the caller's).

    ``default_max_tokens`` caps chat / fork requests that give no max_tokens;
    ``request_timeout_s`` (if set) is every request's deadline; the tokens of the latest
    ``remember`` completions are kept for ``/v1/kvrt/fork`` (and as many stored responses); a request body over
    ``max_input_bytes`` is answered 413; with ``api_key`` every route but ``/health`` needs it as a
    bearer token; a stream whose request has produced nothing for ``sse_keepalive_s`` (waiting in the
    queue, or for its first token) gets an SSE comment, ``: keep-alive``. ``exact_prefix`` is what a request
    (or pin) that sets no ``exact_prefix`` of its own gets (:attr:`kvrt.runtime.requests.Request.exact`).
    ``context_policy`` and ``keep_tokens``: what a prompt longer than a request's cells gets (a 400, or shifted:
    :mod:`kvrt.serve.context_policy`).
    ``agents`` keeps the agents' turns (:mod:`kvrt.serve.http_agents`; None: identities, nothing saved); the
    server closes it in :meth:`stop`.
    """

    def __init__(self, engines: Mapping[str, Engine] | ModelPool, *, default_max_tokens: int = 512,
                 request_timeout_s: float | None = None, remember: int = 1024,
                 max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES, api_key: str | None = None,
                 sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S, exact_prefix: bool = False,
                 context_policy: str = "refuse", keep_tokens: int = 1, agents: AgentBook | None = None) -> None:
        self.pool = engines if isinstance(engines, ModelPool) else ModelPool.fixed(engines)
        if not self.pool.names():
            raise KvrtError("the OpenAI server needs at least one model")
        if isinstance(max_input_bytes, bool) or not isinstance(max_input_bytes, int) or max_input_bytes < 1:
            raise KvrtError(f"max_input_bytes must be a positive integer, got {max_input_bytes!r}")
        if api_key is not None and (not api_key or api_key != api_key.strip()):
            raise KvrtError("api_key must be non-empty, without leading or trailing spaces")
        context_policy, keep_tokens = check_policy(context_policy, keep_tokens)
        if not sse_keepalive_s > 0:
            raise KvrtError(f"sse_keepalive_s must be a positive number of seconds, got {sse_keepalive_s!r}")
        self._api_key = api_key
        self.intake = Intake(max_input_bytes, shifting=context_policy == "shift")
        self.engines = self.pool.engines  # the loaded ones, a live view
        self.agents = agents if agents is not None else AgentBook()
        self.runner = Runner(self.pool, self.agents, default_max_tokens=default_max_tokens,
                             exact_prefix=exact_prefix, request_timeout_s=request_timeout_s,
                             context_policy=context_policy, keep_tokens=keep_tokens,
                             sse_keepalive_s=sse_keepalive_s, remember=remember)
        self.models = ModelRoutes(self.pool, int(time.time()))
        self.kvrt_routes = KvrtRoutes(self.pool, self.models, self.intake, self.runner, self.agents)
        self.responses_routes = ResponsesRoutes(self.models, self.intake, self.runner, remember)
        self._server: Any = None
        self._stopping = False  # stop_accepting() was called: /health says 503
        self._thread: threading.Thread | None = None
        self.metrics = ServerMetrics(self.engines)
        self.app = self._build_app()

    # -- routes -------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvrt", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, self._on_api_error)  # type: ignore[arg-type]
        app.add_exception_handler(HTTPException, self._on_http_error)  # type: ignore[arg-type]
        if self._api_key is not None:
            app.add_middleware(RequireKey, key=self._api_key, open_paths=OPEN_PATHS)
        app.add_middleware(Observe, done=self._answered)  # outermost: refusals of the key are counted too
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models.list_models)
        app.get("/v1/models/{model_id}")(self.models.get_model)
        app.post("/v1/kvrt/models/{name}/load")(self.models.load)
        app.post("/v1/kvrt/models/{name}/unload")(self.models.unload)
        app.post("/v1/kvrt/agents/{agent}/move")(self.kvrt_routes.move_agent)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/responses")(self.responses_routes.responses)
        app.get("/v1/responses/{response_id}")(self.responses_routes.get_response)
        app.delete("/v1/responses/{response_id}")(self.responses_routes.delete_response)
        app.post("/v1/kvrt/fork")(self.kvrt_routes.fork)
        app.post("/v1/kvrt/pins")(self.kvrt_routes.pin)
        app.delete("/v1/kvrt/pins/{pin_id}")(self.kvrt_routes.unpin)
        app.get("/v1/kvrt/stats")(self.kvrt_routes.stats)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        return app

    async def _on_api_error(self, _request: HttpRequest, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def _on_http_error(self, _request: HttpRequest, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind=kind).body(), status_code=exc.status_code)

    async def health(self) -> JSONResponse:
        """200 while serving, 503 once shutting down; each model's waiting and running requests either way."""
        models = {}
        for name, engine in self.engines.items():
            stats = engine.stats()
            models[name] = {"queued": stats.queued, "active": stats.active}
        status = "shutting_down" if self._stopping else "ok"
        return JSONResponse({"status": status, "models": models}, status_code=503 if self._stopping else 200)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def _answered(self, method: str, path: str, status: int, record: RequestRecord) -> None:
        """One request answered: counted under its route's template (``other`` where no route serves it)
        and logged."""
        route = next((r.path for r in self.app.routes if isinstance(r, Route) and r.path_regex.match(path)), "other")
        self.metrics.request_done(route, status, record)
        ttft = "-" if record.ttft_s is None else f"{record.ttft_s * 1e3:.1f}"
        log.info("%s %s model=%s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s total_ms=%.1f", method,
                 route, record.model or "-", status, record.prompt_tokens, record.completion_tokens, ttft,
                 (time.monotonic() - record.started) * 1e3)

    async def completions(self, request: HttpRequest) -> Response:
        body = parse(CompletionBody, await self.intake.json(request))
        if body.echo:
            raise ApiError(400, "echo is not supported by kvrt's server", param="echo", code="unsupported_parameter")
        agent = request_agent(request, getattr(body, "user", None))
        engine = await self.models.engine(request, body.model)
        limit = await self.intake.limit(body.model, engine)
        # token ids are checked here (a pass over them costs less than a hop to a thread and back, and holds the
        # GIL either way); text is tokenized off the loop
        given = single_prompt(body.prompt)
        if isinstance(given, str):
            prompt = await self.intake.off_loop(lambda: completion_prompt(engine.model, given, limit=limit))
        else:
            prompt = completion_prompt(engine.model, given, limit=limit)
        return await self.runner.run(request, "text", body, engine, prompt,
                                     body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs, agent=agent)

    async def chat_completions(self, request: HttpRequest) -> Response:
        body = parse(ChatBody, await self.intake.json(request))
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        agent = request_agent(request, getattr(body, "user", None))
        engine = await self.models.engine(request, body.model)
        prompt, plan = await self.intake.chat_tokens(engine, body)
        return await self.runner.run(request, "chat", body, engine, prompt,
                                     body.max_completion_tokens or body.max_tokens,
                                     (body.top_logprobs or 0) if body.logprobs else None, plan, agent=agent)

    async def tokenize(self, request: HttpRequest) -> dict[str, Any]:
        body = parse(TokenizeBody, await self.intake.json(request))
        model = (await self.models.only_or_named(request, body.model)).model
        tokens = await self.intake.off_loop(lambda: model.tokenize(body.content, add_special=body.add_special,
                                                                   parse_special=True))
        return {"tokens": tokens}

    async def detokenize(self, request: HttpRequest) -> dict[str, Any]:
        body = parse(DetokenizeBody, await self.intake.json(request))
        model = (await self.models.only_or_named(request, body.model)).model
        check_vocab(model, body.tokens, "tokens")
        return {"content": await self.intake.off_loop(lambda: pieces_text(model, body.tokens))}

    # -- serving --------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0, *, wait_s: float = 30.0) -> tuple[str, int]:
        """Serve from a background thread; returns the bound address (``port=0``: an ephemeral one)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:  # in use, not this machine's, or a host name that does not resolve
            sock.close()
            reason = exc.strerror or str(exc)
            if isinstance(exc, socket.gaierror):
                reason = f"the host name {host!r} does not resolve ({reason})"
            raise KvrtError(f"cannot listen on {host}:{port}: {reason}") from None
        server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvrt-http", daemon=True)
        thread.start()
        limit = time.monotonic() + wait_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > limit:
                server.should_exit = True
                sock.close()
                raise KvrtError(f"the HTTP server did not start on {host}:{port} within {wait_s} s")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        return sock.getsockname()[0], sock.getsockname()[1]

    @property
    def runs_on(self) -> str:
        """The event loop and HTTP parser a started server runs on, e.g. ``uvloop + httptools``: uvicorn takes
        those where installed (the serve extra installs them) and falls back to asyncio's own loop and h11, which
        are pure Python and cost the front more CPU a streamed token, time the engine's thread waits out under
        the GIL. ``""`` before :meth:`start`."""
        if self._server is None or not self._server.servers:
            return ""
        loop = type(self._server.servers[0]).__module__.partition(".")[0]
        parser = self._server.config.http_protocol_class.__module__.rpartition(".")[2].removesuffix("_impl")
        return f"{loop} + {parser}"

    def stop_accepting(self) -> None:
        """Begin :meth:`stop`: no new connections; open ones finish (close the engines to end their requests);
        ``/health`` answers 503 from now on."""
        self._stopping = True
        if self._server is not None:
            self._server.should_exit = True

    def stop(self) -> None:
        """Stop a server started with :meth:`start` (waits for open requests; see :meth:`stop_accepting`)."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join()
            self._server = self._thread = None
        self.intake.close()
        self.agents.close()

    def run(self, host: str, port: int) -> None:
        """Serve in this thread until SIGINT / SIGTERM (uvicorn handles both)."""
        import uvicorn

        uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="info", lifespan="off")).run()
