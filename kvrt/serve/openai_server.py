"""kvrt's OpenAI-compatible HTTP server: FastAPI routes over one batching engine per model.

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/responses``
(with ``GET`` / ``DELETE /v1/responses/{id}``; see :mod:`kvrt.serve.responses`) speak OpenAI's wire
format (SSE streaming with ``data: [DONE]``, ``n``, logprobs, stop, seed, penalties,
``response_format`` through the grammar sampler, usage with
``cached_tokens``; chat ``tools`` and ``tool_choice``: see :mod:`kvrt.serve.chat_prompt` and
:mod:`kvrt.serve.tool_calls`); a stream with nothing to send yet gets ``: keep-alive``
comments every ``sse_keepalive_s``; errors are ``{"error": {"message", "type", "param", "code"}}``
with 400 for bad input naming the field, 404 for an unknown model, 503 when an
engine's queue is full. kvrt's own routes live under ``/v1/kvrt/``:

``POST /v1/kvrt/pins`` / ``DELETE /v1/kvrt/pins/{id}``
    keep a prompt's (or rendered messages') cells cached, never evicted, until unpinned;
``POST /v1/kvrt/fork``
    continue choice ``choice`` of an earlier completion (``completion_id``) with more
    text: the new prompt is that completion's exact tokens plus ``prompt``, so the
    prefix cache finds the earlier cells (no detokenize/retokenize drift);
``GET /v1/kvrt/stats``
    every loaded engine's counters (prefilled and reused tokens, slots, cells), and under ``kvrt:models``
    ``kvrt:ledger`` and ``kvrt:agents`` every model's state, the VRAM ledger's numbers and the
    agents' state dir (saved turns, agents waiting to be restored, damaged entries skipped, failed saves);
``POST /v1/kvrt/models/{name}/load`` / ``POST /v1/kvrt/models/{name}/unload``
    load or unload a model of the pool (see :mod:`kvrt.serve.model_routes`: on-demand loads, 507, 409);
``POST /v1/kvrt/agents/{agent}/move``
    ``{"model", "device"}``: an agent's history to the copy of the model on that device (``--replicas``).

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

import asyncio
import contextlib
import functools
import json
import logging
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.routing import Route

from kvrt.errors import KvrtError
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import (
    ChoiceEnd,
    ChoiceResult,
    EngineClosed,
    EngineOverloaded,
    Event,
    Request,
    RequestEnd,
    RequestResult,
    RequestStream,
    RequestTooLarge,
    ResultCollector,
    TokenEvent,
)
from kvrt.serve.api_error import ApiError
from kvrt.serve.chat_prompt import ToolPlan, chat_prompt, tool_plan, tools_of
from kvrt.serve.context_policy import ContextShift, check_policy, shift_prompt
from kvrt.serve.http_agents import HEADER, AgentBook, agent_of
from kvrt.serve.http_middleware import BodyTooLarge, Observe, RequireKey, read_body
from kvrt.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvrt.serve.metrics import RequestRecord, ServerMetrics
from kvrt.serve.model_pool import ModelPool
from kvrt.serve.model_routes import ModelRoutes
from kvrt.serve.openai_format import Kind, Shaper
from kvrt.serve.openai_schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_JSON_DEPTH,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    ForkBody,
    MoveBody,
    PinBody,
    TokenizeBody,
    check_json,
    check_vocab,
    completion_prompt,
    engine_request,
    longest_piece,
    parse,
    pieces_text,
    text_tokens,
)
from kvrt.serve.response_chain import ExactTurn, continued_prompt
from kvrt.serve.responses import StoredResponse, chat_request, output_items, output_turn, response_object
from kvrt.serve.responses_stream import ResponseEvents
from kvrt.serve.sse import KEEPALIVE, Bridge, Waker, paced, sse

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
DEFAULT_MAX_INPUT_BYTES = 4 << 20  # a request body's bytes (a 10 MB chat message froze every client for seconds)
TOKENIZER_THREADS = 2
DEFAULT_SSE_KEEPALIVE_S = 15.0  # under the 30-60 s idle timeouts of common proxies and load balancers
log = logging.getLogger("kvrt.serve.http")  # one info line per answered request (kvrt -v serve shows them)
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (a load balancer's probe has none)
AGENTS_KEY = "kvrt:agents"  # /v1/kvrt/stats: the agents' entry (the pool reserves "kvrt:" names)
_T = TypeVar("_T")
Chunks = AsyncGenerator[dict[str, Any] | None, None]  # a stream's chunks; None: a keep-alive is due


async def _chat_sse(chunks: Chunks) -> AsyncIterator[str]:
    """A chat stream's SSE text: its chunks as ``data:`` events, keep-alives, ``data: [DONE]`` last (closed early,
    it closes ``chunks`` at once, which cancels the request)."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield KEEPALIVE if chunk is None else sse(chunk)
    yield "data: [DONE]\n\n"


def _note(record: RequestRecord, event: Event) -> None:
    """Record a token's arrival or the request's token counts."""
    if isinstance(event, TokenEvent):
        record.token(event.index)
    elif isinstance(event, RequestEnd):
        record.end(event)


class OpenAIServer:
    """The HTTP front over ``engines``: a :class:`ModelPool` (models loaded on demand, unloaded when idle; the
    pool stays the caller's to close) or a mapping of model name -> engine (fixed; the engines stay the caller's).

    ``default_max_tokens`` caps chat / fork requests that give no max_tokens;
    ``request_timeout_s`` (if set) is every request's deadline; the tokens of the latest
    ``remember`` completions are kept for ``/v1/kvrt/fork``; a request body over
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
        self.context_policy, self.keep_tokens = check_policy(context_policy, keep_tokens)
        if not sse_keepalive_s > 0:
            raise KvrtError(f"sse_keepalive_s must be a positive number of seconds, got {sse_keepalive_s!r}")
        self.max_input_bytes = max_input_bytes
        self.sse_keepalive_s = sse_keepalive_s
        self._api_key = api_key
        self._tokenizer = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvrt-tokenize")
        self.engines = self.pool.engines  # the loaded ones, a live view
        self.agents = agents if agents is not None else AgentBook()
        self._loop_waker: Waker | None = None
        self._pieces: dict[str, Future[int]] = {}  # model name -> its longest token's bytes (a vocab pass, lazily)
        self.default_max_tokens = default_max_tokens
        self.exact_prefix = exact_prefix
        self.request_timeout_s = request_timeout_s
        self._remember_n = remember
        self.models = ModelRoutes(self.pool, int(time.time()))
        self._outputs: OrderedDict[str, tuple[str, list[list[int]]]] = OrderedDict()
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # /v1/responses with store
        self._pins: dict[str, tuple[Engine, str, Callable[[], None]]] = {}  # public pin id -> (engine, the
        # engine's pin id, the release of the pin's hold on the model)
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
        app.post("/v1/kvrt/agents/{agent}/move")(self._move_agent)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/responses")(self.responses)
        app.get("/v1/responses/{response_id}")(self.get_response)
        app.delete("/v1/responses/{response_id}")(self.delete_response)
        app.post("/v1/kvrt/fork")(self.fork)
        app.post("/v1/kvrt/pins")(self.pin)
        app.delete("/v1/kvrt/pins/{pin_id}")(self.unpin)
        app.get("/v1/kvrt/stats")(self.stats)
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
        body = parse(CompletionBody, await self._json(request))
        if body.echo:
            raise ApiError(400, "echo is not supported by kvrt's server", param="echo", code="unsupported_parameter")
        agent = self._agent(request, getattr(body, "user", None))
        engine = await self.models.engine(request, body.model)
        limit = await self._limit(body.model, engine)
        prompt = await self._off_loop(lambda: completion_prompt(engine.model, body.prompt, limit=limit))
        return await self._run(request, "text", body, engine, prompt,
                               body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs, agent=agent)

    async def chat_completions(self, request: HttpRequest) -> Response:
        body = parse(ChatBody, await self._json(request))
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        agent = self._agent(request, getattr(body, "user", None))
        engine, prompt, plan = await self._chat_prompt(request, body)
        return await self._run(request, "chat", body, engine, prompt, body.max_completion_tokens or body.max_tokens,
                               (body.top_logprobs or 0) if body.logprobs else None, plan, agent=agent)

    async def _chat_prompt(self, request: HttpRequest, body: ChatBody,
                           earlier: ExactTurn | None = None) -> tuple[Engine, list[int], ToolPlan | None]:
        """A chat body's engine, prompt tokens and tool plan; ``earlier``: the stored turn that ``body`` continues
        (see :mod:`kvrt.serve.response_chain`)."""
        engine = await self.models.engine(request, body.model)
        limit = await self._limit(body.model, engine)
        plan = await self._off_loop(lambda: tool_plan(body, engine.model))
        if earlier is not None:
            prompt = await self._off_loop(lambda: continued_prompt(engine.model, body, earlier, limit=limit))
        else:
            prompt = await self._off_loop(lambda: chat_prompt(engine.model, body.messages, tools=tools_of(body),
                                                              limit=limit))
        return engine, prompt, plan

    async def responses(self, request: HttpRequest) -> Response:
        """``POST /v1/responses`` (see :mod:`kvrt.serve.responses`)."""
        raw = await self._json(request)
        if not isinstance(raw, Mapping):
            raise ApiError(400, "the request body must be a JSON object")
        agent = self._agent(request, raw.get("user"))
        previous = raw.get("previous_response_id")
        earlier = self._stored_response(previous, "previous_response_id") if previous is not None else None
        chat, conversation = chat_request(raw, earlier)
        body = parse(ChatBody, chat)
        engine, prompt, plan = await self._chat_prompt(request, body, earlier.turn if earlier is not None else None)
        stream, bridge, shaper, shift = await self._start(request, "chat", body, engine, prompt, body.max_tokens, None,
                                                    plan, agent)
        headers = shift.headers() if shift is not None else None
        response_id, store = f"resp_{uuid.uuid4().hex}", raw.get("store", True)
        keep = functools.partial(self._store_response, chat, conversation, prompt) if store else None
        if raw.get("stream"):
            writer = ResponseEvents(raw, response_id, int(time.time()))
            choices: list[ChoiceResult] = []
            chunks = await self._chunks(request, stream, bridge, shaper, usage=True, choices=choices)
            return StreamingResponse(self._response_sse(writer, chunks, keep, choices), media_type="text/event-stream",
                                     headers=headers)
        result = await self._collect(request, stream, bridge)
        answer = shaper.response(result)
        choice = answer["choices"][0]
        response = response_object(raw, response_id, answer["created"], output_items(choice["message"]),
                                   finish_reason=choice["finish_reason"], usage=answer["usage"])
        if keep is not None:
            keep(result.choices[0], response)
        return JSONResponse(response if shift is None else {**response, "kvrt": {"context_shift": shift.field()}},
                            headers=headers)

    async def _response_sse(self, writer: ResponseEvents, chunks: Chunks,
                            keep: Callable[[ChoiceResult, dict[str, Any]], None] | None,
                            choices: list[ChoiceResult]) -> AsyncIterator[str]:
        """A streamed response's SSE text; the finished response is kept by ``keep`` (if given) with its choice,
        which ``chunks`` put in ``choices`` as the request ended."""
        for event in writer.opening():
            yield event
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk is None:
                    yield KEEPALIVE
                    continue
                for event in writer.feed(chunk):
                    yield event
        if writer.response is not None and keep is not None:  # the usage chunk came: choices holds the result
            keep(choices[0], writer.response)

    def _store_response(self, chat: dict[str, Any], conversation: list[dict[str, Any]], prompt: list[int],
                        choice: ChoiceResult, response: dict[str, Any]) -> None:
        """Keep ``response`` for ``previous_response_id`` and ``GET``: the conversation it ended (its output last)
        and its turn's exact tokens (``prompt``, then ``choice``'s), which a chain continues from."""
        answer = output_turn(response["output"])
        stored = StoredResponse(response["model"], [*conversation, answer], response,
                                ExactTurn.of(chat, answer, prompt, choice))
        self._keep(self._responses, response["id"], stored)

    async def get_response(self, response_id: str) -> dict[str, Any]:
        return self._stored_response(response_id, "response_id").response

    async def delete_response(self, response_id: str) -> dict[str, Any]:
        self._stored_response(response_id, "response_id")
        del self._responses[response_id]
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _stored_response(self, response_id: Any, param: str) -> StoredResponse:
        stored = self._responses.get(response_id) if isinstance(response_id, str) else None
        if stored is None:
            raise ApiError(404, f"{param}: no stored response {response_id!r} (the latest {self._remember_n} with "
                                "store true are kept)", kind="not_found_error", param=param, code="response_not_found")
        return stored

    async def fork(self, request: HttpRequest) -> Response:
        body = parse(ForkBody, await self._json(request))
        agent = self._agent(request, getattr(body, "user", None))
        engine = await self.models.engine(request, body.model)
        earlier = self._outputs.get(body.completion_id)
        if earlier is None:
            raise ApiError(404, f"no remembered completion {body.completion_id!r} (the latest {self._remember_n} are "
                                "kept)", kind="not_found_error", param="completion_id", code="completion_not_found")
        model_name, choices = earlier
        if model_name != body.model:
            raise ApiError(400, f"completion {body.completion_id!r} was made by {model_name!r}", param="model")
        if body.choice >= len(choices):
            raise ApiError(400, f"choice: completion {body.completion_id!r} has {len(choices)} choice(s)",
                           param="choice")
        limit = await self._limit(body.model, engine)
        held = len(choices[body.choice])
        suffix = await self._off_loop(lambda: text_tokens(engine.model, body.prompt, limit=limit, param="prompt",
                                                          add_special=False, held=held)) if body.prompt else []
        return await self._run(request, "text", body, engine, choices[body.choice] + suffix, body.max_tokens,
                               body.logprobs, agent=agent)

    async def pin(self, request: HttpRequest) -> dict[str, Any]:
        body = parse(PinBody, await self._json(request))
        engine = await self.models.engine(request, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        limit = await self._limit(body.model, engine, shifts=False)  # a pin is never shifted
        tokens = await self._off_loop(lambda: completion_prompt(engine.model, body.prompt, limit=limit)
                                      if body.prompt is not None
                                      else chat_prompt(engine.model, body.messages or [], generation=False,
                                                       limit=limit))
        bridge = Bridge(self._waker())
        exact = self.exact_prefix if body.exact_prefix is None else body.exact_prefix
        stream = self._submit(engine, lambda: engine.pin(tokens, notify=bridge.notify, exact=exact), None)
        result = await self._collect(request, stream, bridge)
        pin_id = f"pin-{uuid.uuid4().hex}"
        held = self.pool.hold(body.model)  # kept until unpinned: a model with pins is never unloaded
        assert held is not None  # this request holds it too
        self._pins[pin_id] = (engine, stream.id, held[1])
        return {"id": pin_id, "object": "kvrt.pin", "model": body.model, "tokens": len(tokens),
                "cached_tokens": result.end.cached_tokens}

    async def unpin(self, pin_id: str) -> dict[str, Any]:
        entry = self._pins.pop(pin_id, None)
        if entry is None:
            raise ApiError(404, f"no pin {pin_id!r}", kind="not_found_error", param="pin_id", code="pin_not_found")
        engine, engine_pin, release = entry
        try:
            deleted = await asyncio.wrap_future(engine.unpin(engine_pin))
        finally:
            release()
        return {"id": pin_id, "object": "kvrt.pin", "deleted": deleted}

    async def _move_agent(self, agent: str, request: HttpRequest) -> dict[str, Any]:
        return await self.models.move_agent(agent, parse(MoveBody, await self._json(request)))

    async def stats(self) -> dict[str, Any]:
        engines = {name: asdict(engine.stats()) for name, engine in self.engines.items()}
        return {**engines, **self.models.stats(), AGENTS_KEY: self.agents.describe()}

    async def tokenize(self, request: HttpRequest) -> dict[str, Any]:
        body = parse(TokenizeBody, await self._json(request))
        model = (await self.models.only_or_named(request, body.model)).model
        tokens = await self._off_loop(lambda: model.tokenize(body.content, add_special=body.add_special,
                                                             parse_special=True))
        return {"tokens": tokens}

    async def detokenize(self, request: HttpRequest) -> dict[str, Any]:
        body = parse(DetokenizeBody, await self._json(request))
        model = (await self.models.only_or_named(request, body.model)).model
        check_vocab(model, body.tokens, "tokens")
        return {"content": await self._off_loop(lambda: pieces_text(model, body.tokens))}

    # -- the shared path ------------------------------------------------------------------
    def _waker(self) -> Waker:
        """The waker of the running loop (one per loop, made on first use)."""
        loop = asyncio.get_running_loop()
        if self._loop_waker is None or self._loop_waker.loop is not loop:
            self._loop_waker = Waker(loop)
        return self._loop_waker

    async def _off_loop(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on the tokenizer threads (tokenizing and chat templates never run on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, fn)

    async def _limit(self, model_name: str, engine: Engine, *, shifts: bool = True) -> tuple[int, int] | None:
        """(cells, longest token's bytes) of a model (``engine``, held by the request): what a prompt's text is
        checked against before tokenizing; ``None`` (no check: ``max_input_bytes`` bounds the text) where the
        shift policy applies to the prompt (``shifts``)."""
        if shifts and self.context_policy == "shift":
            return None
        pieces = self._pieces.get(model_name)
        if pieces is None:
            pieces = self._pieces[model_name] = self._tokenizer.submit(longest_piece, engine.model)
        return engine.n_cells, await asyncio.wrap_future(pieces)

    async def _body(self, request: HttpRequest) -> bytes:
        """The request body, refused with 413 as soon as it is known to exceed ``max_input_bytes``."""
        try:
            return await read_body(request, self.max_input_bytes)
        except BodyTooLarge as exc:
            raise ApiError(413, f"the request body is {exc.size} bytes; this server takes at most "
                                f"{self.max_input_bytes} (kvrt serve --max-input-bytes)",
                           code="request_too_large") from None

    async def _json(self, request: HttpRequest) -> Any:
        raw = await self._body(request)
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                           code="nesting_too_deep") from None
        except ValueError:  # UnicodeDecodeError included
            raise ApiError(400, "the request body is not valid JSON (UTF-8)") from None
        check_json(body)
        return body

    def _agent(self, request: HttpRequest, user: Any) -> str | None:
        """The agent ``request`` names (header or ``user``; see :func:`kvrt.serve.http_agents.agent_of`)."""
        return agent_of(request.headers.get(HEADER), user)

    async def _run(self, request: HttpRequest, kind: Kind, body: Any, engine: Engine, prompt: list[int],
                   max_tokens: int | None, logprobs: int | None, tools: ToolPlan | None = None, *,
                   agent: str | None = None) -> Response:
        stream, bridge, shaper, shift = await self._start(request, kind, body, engine, prompt, max_tokens, logprobs,
                                                          tools, agent)
        headers = shift.headers() if shift is not None else None
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = await self._chunks(request, stream, bridge, shaper, usage)
            return StreamingResponse(_chat_sse(chunks), media_type="text/event-stream", headers=headers)
        result = await self._collect(request, stream, bridge)
        self._remember(shaper.id, body.model, list(stream.request.prompt), result.choices)  # the tokens computed
        answer = shaper.response(result)
        return JSONResponse(answer if shift is None else {**answer, "kvrt": {"context_shift": shift.field()}},
                            headers=headers)

    async def _start(self, request: HttpRequest, kind: Kind, body: Any, engine: Engine, prompt: list[int],
                     max_tokens: int | None, logprobs: int | None, tools: ToolPlan | None,
                     agent: str | None = None) -> tuple[RequestStream, Bridge, Shaper, ContextShift | None]:
        """Submit ``body``'s request for ``prompt`` (shifted to fit, under the shift policy; ``agent``'s turn: its
        saved history restored first, the turn saved before it is answered, see :mod:`kvrt.serve.http_agents`):
        its event stream, the bridge that wakes its reader, the shaper of its answer, and the shift (``None``: the
        prompt as given)."""
        if self.pool.replicas > 1:  # the copy holding the longest prefix of the prompt (an agent's history)
            engine = await asyncio.to_thread(self.pool.route, body.model, engine, prompt)
        shift = None
        if self.context_policy == "shift":
            prompt, shift = shift_prompt(prompt, engine.config, n=body.n, max_tokens=max_tokens or
                                         self.default_max_tokens, keep=self.keep_tokens)
        try:
            job = engine_request(body, prompt, n_cells=engine.n_cells, n_vocab=engine.model.n_vocab,
                                 max_tokens=max_tokens, default_max_tokens=self.default_max_tokens, logprobs=logprobs,
                                 grammar=tools.grammar if tools is not None else None,
                                 exact_prefix=self.exact_prefix)
            turn = self.agents.turn(agent, engine, job.n)
            job = replace(job, agent=agent, at_end=turn.capture if turn is not None else None)
            if self.request_timeout_s is not None:
                job = replace(job, deadline=time.monotonic() + self.request_timeout_s)
        except KvrtError as exc:
            raise ApiError(400, str(exc)) from None
        await asyncio.to_thread(self.agents.prepare, agent, body.model, engine)
        record: RequestRecord = request.state.kvrt
        record.model = body.model
        bridge = Bridge(self._waker())
        grammar_field = "tools" if tools is not None and tools.grammar is not None else "response_format"
        stream = self._submit(engine, lambda: engine.submit(job, notify=bridge.notify), job, grammar_field)
        self.agents.track(stream.id, turn)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        shaper = Shaper(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), body.model, engine.model, job.n,
                        logprobs is not None, tokens=kind == "text" and body.return_tokens,
                        tools=tools.names if tools is not None else None)
        return stream, bridge, shaper, shift

    def _submit(self, engine: Engine, submit: Callable[[], RequestStream], job: Request | None,
                grammar_field: str = "response_format") -> RequestStream:
        """``submit()`` with the engine's refusals turned into HTTP errors (a grammar's named as ``grammar_field``,
        the request field it came from)."""
        try:
            return submit()
        except RequestTooLarge as exc:
            param = "n" if job is not None and job.n > engine.cache.n_slots else ("max_tokens" if job else "prompt")
            raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
        except (EngineOverloaded, EngineClosed) as exc:
            raise ApiError(503, str(exc), kind="server_error", code="overloaded") from None
        except KvrtError as exc:  # a grammar llama.cpp refused, a token outside the vocabulary, ...
            grammar = job is not None and job.params.sampling.grammar is not None
            raise ApiError(400, str(exc), param=grammar_field if grammar else None) from None

    async def _watching(self, request: HttpRequest, stream: RequestStream) -> asyncio.Task[None]:
        """A task that cancels ``stream`` when the client goes away."""
        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            stream.cancel()

        return asyncio.create_task(watch())

    @staticmethod
    def _raise_refusal(error: KvrtError | None) -> None:
        if isinstance(error, RequestTooLarge):
            raise ApiError(400, str(error), param="prompt", code="context_length_exceeded")
        if error is not None:
            raise ApiError(500, f"the request failed: {error}", kind="server_error")

    async def _collect(self, request: HttpRequest, stream: RequestStream, bridge: Bridge) -> RequestResult:
        """The whole result; the request is cancelled if the client goes away meanwhile."""
        watcher = await self._watching(request, stream)
        collector = ResultCollector(stream.request.n)
        result: RequestResult | None = None
        try:
            async for event in bridge.events(stream):
                _note(request.state.kvrt, event)
                result = collector.add(event) or result
            if result is not None and result.end.error is None:
                await self.agents.finish(stream.id)
        finally:
            watcher.cancel()
            stream.cancel()  # harmless when the request is over
            self.agents.drop(stream.id)
        assert result is not None  # events() ends with the RequestEnd
        self._raise_refusal(result.end.error)
        return result

    async def _admitted(self, request: HttpRequest, stream: RequestStream,
                        events: AsyncIterator[Event | None]) -> list[Event | None]:
        """A streamed request's events up to its first output, or up to the first keep-alive's ``None``: raises
        the same HTTP error as an unstreamed request when the engine refused it at admission (every choice
        ended "error" with nothing out) before then; a later refusal is the stream's error event."""
        watcher = await self._watching(request, stream)
        first: list[Event | None] = []
        try:
            async for event in events:
                first.append(event)
                if not (isinstance(event, ChoiceEnd) and event.finish_reason == "error" and not event.tokens):
                    break
        except BaseException:
            stream.cancel()
            raise
        finally:
            watcher.cancel()
        last = first[-1] if first else None
        if isinstance(last, RequestEnd) and last.error is not None and last.completion_tokens == 0:
            self._raise_refusal(last.error)
        return first

    async def _chunks(self, request: HttpRequest, stream: RequestStream, bridge: Bridge, shaper: Shaper,
                      usage: bool, choices: list[ChoiceResult] | None = None) -> Chunks:
        """A streamed request's chunks, once it was admitted (a refusal before its first output or keep-alive is
        raised here as an HTTP error); see :meth:`_stream`."""
        events = paced(bridge.events(stream), self.sse_keepalive_s)
        try:
            first = await self._admitted(request, stream, events)
        except BaseException:
            self.agents.drop(stream.id)
            raise
        return self._stream(stream, events, first, shaper, usage, request.state.kvrt, choices)

    async def _stream(self, stream: RequestStream, events: AsyncIterator[Event | None], first: list[Event | None],
                      shaper: Shaper, usage: bool, record: RequestRecord,
                      choices: list[ChoiceResult] | None = None) -> Chunks:
        """Chat chunks as tokens arrive (``first``: the events already taken from ``events``), an error body if
        the request failed, and ``None`` where a keep-alive is due; leaving early (a disconnect) cancels the
        request. A request that ends without an error puts its choices' results in ``choices`` (if given)."""
        collector = ResultCollector(stream.request.n)

        async def everything() -> AsyncIterator[Event | None]:
            for event in first:
                yield event
            if not isinstance(first[-1], RequestEnd):
                async for event in events:
                    yield event

        try:
            opening = shaper.role_chunk()
            if opening is not None:
                yield opening
            async for event in everything():
                if event is None:
                    yield None
                    continue
                _note(record, event)
                collector.add(event)
                if isinstance(event, TokenEvent):
                    for chunk in shaper.token_chunks(event):
                        yield chunk
                elif isinstance(event, ChoiceEnd):
                    for chunk in shaper.end_chunks(event):
                        yield chunk
                elif event.error is not None:
                    yield ApiError(500, f"the request failed: {event.error}", kind="server_error").body()
                else:
                    await self.agents.finish(stream.id)
                    self._remember(shaper.id, shaper.model_name, list(stream.request.prompt), collector.choices)
                    if choices is not None:
                        choices.extend(collector.choices)
                    if usage:
                        yield shaper.usage_chunk(event)
        finally:
            stream.cancel()
            self.agents.drop(stream.id)

    def _remember(self, completion_id: str, model: str, prompt: list[int], choices: list[ChoiceResult]) -> None:
        self._keep(self._outputs, completion_id, (model, [list(prompt) + c.tokens for c in choices]))

    def _keep(self, kept: OrderedDict[str, _T], key: str, value: _T) -> None:
        """``kept[key] = value``, the oldest entries dropped beyond ``remember``."""
        kept[key] = value
        while len(kept) > self._remember_n:
            kept.popitem(last=False)

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
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        self.agents.close()

    def run(self, host: str, port: int) -> None:
        """Serve in this thread until SIGINT / SIGTERM (uvicorn handles both)."""
        import uvicorn

        uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="info", lifespan="off")).run()
