"""The Responses API's HTTP routes: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat request underneath (:mod:`kvrt.serve.responses` translates the body and the answer,
:mod:`kvrt.serve.responses_stream` the stream's events), run by :class:`kvrt.serve.http_runner.Runner` like any
chat completion. A response made with ``store`` (the default) is kept among the latest ``remember``
(:mod:`kvrt.serve.recent`) for ``GET``, ``DELETE`` and ``previous_response_id``. Invariant: a stored response keeps
its turn's exact tokens (prompt, then output), and a chain that continues it starts from those tokens, never from
its text retokenized (:mod:`kvrt.serve.response_chain`), so the prefix cache finds its cells; a response is stored
only once its request ended well.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvrt.runtime.requests import ChoiceResult
from kvrt.serve.api_error import ApiError
from kvrt.serve.http_intake import Intake, request_agent
from kvrt.serve.http_runner import Chunks, Runner
from kvrt.serve.model_routes import ModelRoutes
from kvrt.serve.openai_schema import ChatBody, parse
from kvrt.serve.recent import Recent
from kvrt.serve.response_chain import ExactTurn
from kvrt.serve.responses import StoredResponse, chat_request, output_items, output_turn, response_object
from kvrt.serve.responses_stream import ResponseEvents
from kvrt.serve.sse import KEEPALIVE


class ResponsesRoutes:
    """The Responses API's routes, their models found through ``models``, their input taken through ``intake`` and
    their requests run by ``runner``; the latest ``remember`` stored responses are kept."""

    def __init__(self, models: ModelRoutes, intake: Intake, runner: Runner, remember: int) -> None:
        self.models = models
        self.intake = intake
        self.runner = runner
        self._responses: Recent[StoredResponse] = Recent(remember)

    async def responses(self, request: HttpRequest) -> Response:
        """``POST /v1/responses`` (see :mod:`kvrt.serve.responses`)."""
        raw = await self.intake.json(request)
        if not isinstance(raw, Mapping):
            raise ApiError(400, "the request body must be a JSON object")
        agent = request_agent(request, raw.get("user"))
        previous = raw.get("previous_response_id")
        earlier = self._stored(previous, "previous_response_id") if previous is not None else None
        chat, conversation = chat_request(raw, earlier)
        body = parse(ChatBody, chat)
        engine = await self.models.engine(request, body.model)
        prompt, plan = await self.intake.chat_tokens(engine, body, earlier.turn if earlier is not None else None)
        stream, bridge, shaper, shift = await self.runner.start(request, "chat", body, engine, prompt,
                                                                body.max_tokens, None, plan, agent)
        headers = shift.headers() if shift is not None else None
        response_id, store = f"resp_{uuid.uuid4().hex}", raw.get("store", True)
        keep = functools.partial(self._store, chat, conversation, prompt) if store else None
        if raw.get("stream"):
            writer = ResponseEvents(raw, response_id, int(time.time()))
            choices: list[ChoiceResult] = []
            chunks = await self.runner.chunks(request, stream, bridge, shaper, usage=True, choices=choices)
            return StreamingResponse(self._sse(writer, chunks, keep, choices), media_type="text/event-stream",
                                     headers=headers)
        result = await self.runner.collect(request, stream, bridge)
        answer = shaper.response(result)
        choice = answer["choices"][0]
        response = response_object(raw, response_id, answer["created"], output_items(choice["message"]),
                                   finish_reason=choice["finish_reason"], usage=answer["usage"])
        if keep is not None:
            keep(result.choices[0], response)
        return JSONResponse(response if shift is None else {**response, "kvrt": {"context_shift": shift.field()}},
                            headers=headers)

    async def get_response(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id, "response_id").response

    async def delete_response(self, response_id: str) -> dict[str, Any]:
        self._stored(response_id, "response_id")
        self._responses.remove(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @staticmethod
    async def _sse(writer: ResponseEvents, chunks: Chunks, keep: Callable[[ChoiceResult, dict[str, Any]], None] | None,
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

    def _store(self, chat: dict[str, Any], conversation: list[dict[str, Any]], prompt: list[int],
               choice: ChoiceResult, response: dict[str, Any]) -> None:
        """Keep ``response`` for ``previous_response_id`` and ``GET``: the conversation it ended (its output last)
        and its turn's exact tokens (``prompt``, then ``choice``'s), which a chain continues from."""
        answer = output_turn(response["output"])
        stored = StoredResponse(response["model"], [*conversation, answer], response,
                                ExactTurn.of(chat, answer, prompt, choice))
        self._responses.add(response["id"], stored)

    def _stored(self, response_id: Any, param: str) -> StoredResponse:
        stored = self._responses.get(response_id) if isinstance(response_id, str) else None
        if stored is None:
            raise ApiError(404, f"{param}: no stored response {response_id!r} (the latest {self._responses.limit} "
                                "with store true are kept)", kind="not_found_error", param=param,
                           code="response_not_found")
        return stored
