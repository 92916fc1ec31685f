"""The HTTP front's runner: a parsed request's prompt fed to its model's engine, and the engine's events turned into
an OpenAI answer, whole or streamed as SSE.

Every route that generates (completions, chat, the Responses API, fork) and pins go through :class:`Runner`, so a
request is submitted, watched, recorded and answered one way whatever route it came by. Invariants:

* an engine's refusal is an HTTP error (400 naming the field, 503 for a full queue), and a stream refused before
  its first output answers with the same error as an unstreamed request, not a stream holding an error event;
* a client that disconnects cancels its request (its slot is freed at the next step), and every request's stream
  is cancelled and its agent's turn dropped once its answer is over, however it ended;
* an agent's turn is saved before its answer's end is sent (:mod:`kvrt.serve.http_agents`);
* a stream with nothing to send for ``sse_keepalive_s`` gets an SSE ``: keep-alive`` comment;
* every finished completion's exact tokens are remembered (:mod:`kvrt.serve.recent`) for ``/v1/kvrt/fork``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
from kvrt.serve.chat_prompt import ToolPlan
from kvrt.serve.context_policy import ContextShift, shift_prompt
from kvrt.serve.http_agents import AgentBook
from kvrt.serve.metrics import RequestRecord
from kvrt.serve.model_pool import ModelPool
from kvrt.serve.openai_format import Kind, Shaper
from kvrt.serve.openai_schema import engine_request
from kvrt.serve.recent import Recent
from kvrt.serve.sse import KEEPALIVE, Bridge, Waker, sse

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
DEFAULT_SSE_KEEPALIVE_S = 15.0  # under the 30-60 s idle timeouts of common proxies and load balancers
Chunks = AsyncGenerator[dict[str, Any] | None, None]  # a stream's chunks; None: a keep-alive is due
Output = tuple[str, list[list[int]]]  # a completion's model and each choice's tokens (its prompt's, then its own)


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


def _raise_refusal(error: KvrtError | None) -> None:
    """The HTTP error of a request that ended with ``error`` (``None``: it did not fail, nothing raised)."""
    if isinstance(error, RequestTooLarge):
        raise ApiError(400, str(error), param="prompt", code="context_length_exceeded")
    if error is not None:
        raise ApiError(500, f"the request failed: {error}", kind="server_error")


async def _watching(request: HttpRequest, stream: RequestStream) -> asyncio.Task[None]:
    """A task that cancels ``stream`` when the client goes away."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        stream.cancel()

    return asyncio.create_task(watch())


async def _admitted(request: HttpRequest, stream: RequestStream,
                    events: AsyncIterator[Event | None]) -> list[Event | None]:
    """A streamed request's events up to its first output, or up to the first keep-alive's ``None``: raises
    the same HTTP error as an unstreamed request when the engine refused it at admission (every choice
    ended "error" with nothing out) before then; a later refusal is the stream's error event."""
    watcher = await _watching(request, stream)
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
        _raise_refusal(last.error)
    return first


class Runner:
    """Requests fed to the engines of ``pool`` and answered; ``agents`` keeps the agents' turns.

    ``default_max_tokens`` caps requests that give no max_tokens; ``exact_prefix`` is what a request (or pin) that
    sets no ``exact_prefix`` of its own gets; ``request_timeout_s`` (if set) is every request's deadline;
    ``context_policy`` and ``keep_tokens``: what a prompt longer than a request's cells gets
    (:mod:`kvrt.serve.context_policy`); the tokens of the latest ``remember`` completions are kept in
    :attr:`outputs`.
    """

    def __init__(self, pool: ModelPool, agents: AgentBook, *, default_max_tokens: int, exact_prefix: bool,
                 request_timeout_s: float | None, context_policy: str, keep_tokens: int, sse_keepalive_s: float,
                 remember: int) -> None:
        self.pool = pool
        self.agents = agents
        self.default_max_tokens = default_max_tokens
        self.exact_prefix = exact_prefix
        self.request_timeout_s = request_timeout_s
        self.context_policy = context_policy
        self.keep_tokens = keep_tokens
        self.sse_keepalive_s = sse_keepalive_s
        self.outputs: Recent[Output] = Recent(remember)  # completion id -> its tokens, for /v1/kvrt/fork
        self._loop_waker: Waker | None = None

    async def run(self, request: HttpRequest, kind: Kind, body: Any, engine: Engine, prompt: list[int],
                  max_tokens: int | None, logprobs: int | None, tools: ToolPlan | None = None, *,
                  agent: str | None = None) -> Response:
        """Submit ``body``'s request for ``prompt`` (see :meth:`start`) and answer it: whole, or as an SSE
        stream where ``body`` asks for one."""
        stream, bridge, shaper, shift = await self.start(request, kind, body, engine, prompt, max_tokens, logprobs,
                                                         tools, agent)
        headers = shift.headers() if shift is not None else None
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = await self.chunks(request, stream, bridge, shaper, usage)
            return StreamingResponse(_chat_sse(chunks), media_type="text/event-stream", headers=headers)
        result = await self.collect(request, stream, bridge)
        self._remember(shaper.id, body.model, list(stream.request.prompt), result.choices)  # the tokens computed
        answer = shaper.response(result)
        return JSONResponse(answer if shift is None else {**answer, "kvrt": {"context_shift": shift.field()}},
                            headers=headers)

    async def start(self, request: HttpRequest, kind: Kind, body: Any, engine: Engine, prompt: list[int],
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
            turn = self.agents.turn(agent, engine, body.n)
            job = engine_request(body, prompt, n_cells=engine.n_cells, n_vocab=engine.model.n_vocab,
                                 max_tokens=max_tokens, default_max_tokens=self.default_max_tokens, logprobs=logprobs,
                                 grammar=tools.grammar if tools is not None else None,
                                 exact_prefix=self.exact_prefix, agent=agent,
                                 at_end=turn.capture if turn is not None else None,
                                 deadline=None if self.request_timeout_s is None
                                 else time.monotonic() + self.request_timeout_s)
        except KvrtError as exc:
            raise ApiError(400, str(exc)) from None
        if self.agents.restoring(agent):
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

    async def pin(self, request: HttpRequest, engine: Engine, tokens: list[int],
                  exact: bool | None) -> tuple[str, RequestResult]:
        """Pin ``tokens``' cells in ``engine`` (``exact``: the pin's ``exact_prefix``, ``None`` for the server's):
        the engine's pin id and the pin's result."""
        bridge = Bridge(self._waker())
        exact_prefix = self.exact_prefix if exact is None else exact
        stream = self._submit(engine, lambda: engine.pin(tokens, notify=bridge.notify, exact=exact_prefix), None)
        result = await self.collect(request, stream, bridge)
        return stream.id, result

    def _waker(self) -> Waker:
        """The waker of the running loop (one per loop, made on first use)."""
        loop = asyncio.get_running_loop()
        if self._loop_waker is None or self._loop_waker.loop is not loop:
            self._loop_waker = Waker(loop)
        return self._loop_waker

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

    async def collect(self, request: HttpRequest, stream: RequestStream, bridge: Bridge) -> RequestResult:
        """The whole result; the request is cancelled if the client goes away meanwhile."""
        watcher = await _watching(request, stream)
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
        _raise_refusal(result.end.error)
        return result

    async def chunks(self, request: HttpRequest, stream: RequestStream, bridge: Bridge, shaper: Shaper,
                     usage: bool, choices: list[ChoiceResult] | None = None) -> Chunks:
        """A streamed request's chunks, once it was admitted (a refusal before its first output or keep-alive is
        raised here as an HTTP error); see :meth:`_stream`."""
        events = bridge.paced(stream, self.sse_keepalive_s)
        try:
            first = await _admitted(request, stream, events)
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
        self.outputs.add(completion_id, (model, [list(prompt) + c.tokens for c in choices]))
