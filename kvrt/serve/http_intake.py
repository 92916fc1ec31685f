"""The HTTP front's intake: a request's body read and parsed as JSON, its agent named, its prompt's text tokenized.

Every route (OpenAI's, the Responses API's, kvrt's own) takes its input through :class:`Intake`, so one set of limits
holds for all of them and a bad input is refused with an OpenAI-shaped error before any engine sees it. Invariants:

* a body over ``max_input_bytes`` is refused with 413 as soon as that is known, never read whole (a 10 MB chat
  message froze every client for seconds);
* a body that is not JSON (UTF-8), nests deeper than ``MAX_JSON_DEPTH`` or holds strings UTF-8 cannot encode
  (:func:`kvrt.serve.openai_schema.check_json`) is a 400 before a route parses it;
* tokenizing and chat templates run on the tokenizer threads, never on the event loop (a long text would stall
  every client);
* a prompt whose text cannot fit the model's cells is refused before it is tokenized, except where the shift
  policy (:mod:`kvrt.serve.context_policy`) fits it to the cells instead.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request as HttpRequest

from kvrt.runtime.batching import Engine
from kvrt.serve.api_error import ApiError
from kvrt.serve.chat_prompt import ToolPlan, chat_prompt, tool_plan, tools_of
from kvrt.serve.http_agents import HEADER, agent_of
from kvrt.serve.http_middleware import BodyTooLarge, read_body
from kvrt.serve.openai_schema import MAX_JSON_DEPTH, ChatBody, check_json, longest_piece
from kvrt.serve.response_chain import ExactTurn, continued_prompt

DEFAULT_MAX_INPUT_BYTES = 4 << 20  # a request body's bytes (a 10 MB chat message froze every client for seconds)
TOKENIZER_THREADS = 2
_T = TypeVar("_T")


def request_agent(request: HttpRequest, user: Any) -> str | None:
    """The agent ``request`` names (header or ``user``; see :func:`kvrt.serve.http_agents.agent_of`)."""
    return agent_of(request.headers.get(HEADER), user)


class Intake:
    """Request bodies up to ``max_input_bytes``, and prompts tokenized on the tokenizer threads; ``shifting``: the
    shift policy applies, so a prompt's text is not checked against the cells (``max_input_bytes`` bounds it).
    :meth:`close` stops the tokenizer threads."""

    def __init__(self, max_input_bytes: int, *, shifting: bool) -> None:
        self.max_input_bytes = max_input_bytes
        self.shifting = shifting
        self._tokenizer = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvrt-tokenize")
        self._pieces: dict[str, Future[int]] = {}  # model name -> its longest token's bytes (a vocab pass, lazily)

    async def json(self, request: HttpRequest) -> Any:
        """The request body's JSON (checked by :func:`kvrt.serve.openai_schema.check_json`)."""
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

    async def _body(self, request: HttpRequest) -> bytes:
        """The request body, refused with 413 as soon as it is known to exceed ``max_input_bytes``."""
        try:
            return await read_body(request, self.max_input_bytes)
        except BodyTooLarge as exc:
            raise ApiError(413, f"the request body is {exc.size} bytes; this server takes at most "
                                f"{self.max_input_bytes} (kvrt serve --max-input-bytes)",
                           code="request_too_large") from None

    async def off_loop(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on the tokenizer threads (tokenizing and chat templates never run on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, fn)

    async def limit(self, model_name: str, engine: Engine, *, shifts: bool = True) -> tuple[int, int] | None:
        """(cells, longest token's bytes) of a model (``engine``, held by the request): what a prompt's text is
        checked against before tokenizing; ``None`` (no check: ``max_input_bytes`` bounds the text) where the
        shift policy applies to the prompt (``shifts``)."""
        if shifts and self.shifting:
            return None
        pieces = self._pieces.get(model_name)
        if pieces is None:
            pieces = self._pieces[model_name] = self._tokenizer.submit(longest_piece, engine.model)
        if pieces.done():  # known: awaiting a finished thread future still costs a loop wake-up
            return engine.n_cells, pieces.result()
        return engine.n_cells, await asyncio.wrap_future(pieces)

    async def chat_tokens(self, engine: Engine, body: ChatBody,
                          earlier: ExactTurn | None = None) -> tuple[list[int], ToolPlan | None]:
        """A chat body's prompt tokens for ``engine`` (held by the request) and its tool plan; ``earlier``: the
        stored turn that ``body`` continues (see :mod:`kvrt.serve.response_chain`)."""
        limit = await self.limit(body.model, engine)
        plan = await self.off_loop(lambda: tool_plan(body, engine.model))
        if earlier is not None:
            prompt = await self.off_loop(lambda: continued_prompt(engine.model, body, earlier, limit=limit))
        else:
            prompt = await self.off_loop(lambda: chat_prompt(engine.model, body.messages, tools=tools_of(body),
                                                             limit=limit))
        return prompt, plan

    def close(self) -> None:
        """Stop the tokenizer threads (queued work is cancelled)."""
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
