"""The HTTP side of the model pool (:mod:`kvrt.serve.model_pool`): finding a request's engine (loading it on
demand), the model list, and kvrt's load and unload routes.

``GET /v1/models`` lists every model the pool can serve, each card with ``"loaded": true|false``. A request for a
model that is not loaded waits for its load (one load however many requests wait); the request holds the model
from then until its answer is sent, so it is never unloaded under it. Errors, OpenAI-shaped:

* 404 ``model_not_found``: no such model;
* 507 ``insufficient_memory``: the ledger cannot admit the model's weights and context even after unloading every
  idle model; the message is the ledger's refusal (needed, allocated, capacity, what is left) and nothing of the
  refused load stays charged. 507 rather than 503: retrying soon helps only once other models fall idle, and 503
  already means a full queue;
* 409 ``model_busy`` (``POST /v1/kvrt/models/{name}/unload`` only): requests or pins hold the model, its engine
  has queued or running requests, or it is loading. The route refuses rather than waits: an operator's unload
  should not hang behind a long stream, and a refusal says who holds it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request as HttpRequest

from kvrt.accounting.ledger import LedgerDenied
from kvrt.errors import KvrtError
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import AgentBusy, EngineClosed
from kvrt.serve.api_error import ApiError
from kvrt.serve.model_pool import ModelBusy, ModelPool, UnknownModel
from kvrt.serve.openai_schema import MoveBody
from kvrt.serve.results import check_agent_id

LOAD_TRIES = 3  # a model unloaded between its load and this request's hold is loaded again, this many times


def api_error(exc: KvrtError) -> ApiError:
    """The HTTP error for a pool's refusal (see the module docstring)."""
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), kind="not_found_error", param="model", code="model_not_found")
    if isinstance(exc, LedgerDenied):
        return ApiError(507, f"the model does not fit: {exc}", kind="server_error", code="insufficient_memory")
    if isinstance(exc, ModelBusy):
        return ApiError(409, str(exc), code="model_busy")
    if isinstance(exc, EngineClosed):
        return ApiError(503, str(exc), kind="server_error", code="overloaded")
    return ApiError(500, f"loading the model failed: {exc}", kind="server_error")


class ModelRoutes:
    """Model lookup and the model routes over ``pool``; ``created`` is the cards' timestamp."""

    def __init__(self, pool: ModelPool, created: int) -> None:
        self.pool = pool
        self.created = created

    async def engine(self, request: HttpRequest, name: str) -> Engine:
        """``name``'s engine, loaded first if need be, held until ``request`` is answered."""
        for _ in range(LOAD_TRIES):
            try:
                held = self.pool.hold(name)
            except KvrtError as exc:
                raise api_error(exc) from None
            if held is not None:
                engine, release = held
                request.state.kvrt.releases.append(release)
                return engine
            await self._load(name)
        raise ApiError(503, f"the model {name!r} was unloaded again before this request could use it; retry",
                       kind="server_error", code="overloaded")

    async def only_or_named(self, request: HttpRequest, name: str | None) -> Engine:
        """The engine of model ``name``; with none named, the server's only model (a 400 when it has several)."""
        if name is None:
            names = self.pool.names()
            if len(names) > 1:
                raise ApiError(400, f"model: this server has {names}; name one", param="model")
            name = names[0]
        return await self.engine(request, name)

    async def _load(self, name: str) -> None:
        try:
            await asyncio.wrap_future(self.pool.load(name))
        except KvrtError as exc:
            raise api_error(exc) from None

    def card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kvrt",
                "loaded": self.pool.is_loaded(name)}

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card(name) for name in self.pool.names()]}

    async def get_model(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.pool.names():
            raise api_error(UnknownModel(f"the model {model_id!r} does not exist; this server has "
                                         f"{self.pool.names()}"))
        return self.card(model_id)

    async def load(self, name: str) -> dict[str, Any]:
        """``POST /v1/kvrt/models/{name}/load``: load it now (idle models unloaded to make room); its card."""
        await self._load(name)
        return self.card(name)

    async def unload(self, name: str) -> dict[str, Any]:
        """``POST /v1/kvrt/models/{name}/unload``: its card, ``unloaded`` saying whether it was loaded."""
        try:
            unloaded = await asyncio.to_thread(self.pool.unload, name)  # closing an engine joins its thread
        except KvrtError as exc:
            raise api_error(exc) from None
        return {**self.card(name), "unloaded": unloaded}

    async def move_agent(self, agent: str, body: MoveBody) -> dict[str, Any]:
        """``POST /v1/kvrt/agents/{agent}/move`` ``{"model", "device"}``: the agent's history moved to that copy of
        the model (:meth:`kvrt.serve.model_pool.ModelPool.move_agent`); ``moved_tokens`` 0 when no other copy kept
        any. 400 for an agent id that is not one or a device with no copy (or no room there), 404 for an unknown
        model, 409 for a model not loaded or while a request of the agent runs."""
        try:
            agent = check_agent_id(agent)
        except KvrtError as exc:
            raise ApiError(400, f"agent: {exc}", param="agent", code="invalid_agent_id") from None
        if body.model not in self.pool.names():
            raise api_error(UnknownModel(f"the model {body.model!r} does not exist; this server has "
                                         f"{self.pool.names()}"))
        if not self.pool.is_loaded(body.model):
            raise ApiError(409, f"the model {body.model!r} is not loaded: no agent's history is kept in it",
                           code="model_not_loaded")
        try:
            moved = await asyncio.to_thread(self.pool.move_agent, body.model, agent, body.device)
        except AgentBusy as exc:
            raise ApiError(409, str(exc), code="agent_busy") from None
        except EngineClosed as exc:
            raise api_error(exc) from None
        except KvrtError as exc:
            raise ApiError(400, str(exc), param="device") from None
        return {"object": "kvrt.agent_move", "agent": agent, "model": body.model, "device": body.device,
                "moved_tokens": moved}

    def stats(self) -> dict[str, Any]:
        """The pool's and the ledger's state, under keys no model's name can take."""
        ledger = self.pool.ledger_state()
        return {"kvrt:models": self.pool.describe(), **({"kvrt:ledger": ledger} if ledger is not None else {})}
