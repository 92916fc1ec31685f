"""kvrt's own HTTP routes, under ``/v1/kvrt/`` beside OpenAI's: what an agent runtime offers that OpenAI's API has
no words for.

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
``POST /v1/kvrt/agents/{agent}/move``
    ``{"model", "device"}``: an agent's history to the copy of the model on that device (``--replicas``).

(``POST /v1/kvrt/models/{name}/load`` and ``.../unload`` are :mod:`kvrt.serve.model_routes`'.) Invariant: a model
with pins is never unloaded: each pin holds its model from the pin until its unpin.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from kvrt.runtime.batching import Engine
from kvrt.serve.api_error import ApiError
from kvrt.serve.chat_prompt import chat_prompt
from kvrt.serve.http_agents import AgentBook
from kvrt.serve.http_intake import Intake, request_agent
from kvrt.serve.http_runner import Runner
from kvrt.serve.model_pool import ModelPool
from kvrt.serve.model_routes import ModelRoutes
from kvrt.serve.openai_schema import ForkBody, MoveBody, PinBody, completion_prompt, parse, text_tokens

AGENTS_KEY = "kvrt:agents"  # /v1/kvrt/stats: the agents' entry (the pool reserves "kvrt:" names)


class KvrtRoutes:
    """The ``/v1/kvrt/`` routes over ``pool`` (its models found through ``models``), taking their input through
    ``intake`` and running requests through ``runner``; ``agents``: the agents described in the stats."""

    def __init__(self, pool: ModelPool, models: ModelRoutes, intake: Intake, runner: Runner,
                 agents: AgentBook) -> None:
        self.pool = pool
        self.models = models
        self.intake = intake
        self.runner = runner
        self.agents = agents
        self._pins: dict[str, tuple[Engine, str, Callable[[], None]]] = {}  # public pin id -> (engine, the
        # engine's pin id, the release of the pin's hold on the model)

    async def fork(self, request: HttpRequest) -> Response:
        body = parse(ForkBody, await self.intake.json(request))
        agent = request_agent(request, getattr(body, "user", None))
        engine = await self.models.engine(request, body.model)
        outputs = self.runner.outputs
        earlier = outputs.get(body.completion_id)
        if earlier is None:
            raise ApiError(404, f"no remembered completion {body.completion_id!r} (the latest {outputs.limit} are "
                                "kept)", kind="not_found_error", param="completion_id", code="completion_not_found")
        model_name, choices = earlier
        if model_name != body.model:
            raise ApiError(400, f"completion {body.completion_id!r} was made by {model_name!r}", param="model")
        if body.choice >= len(choices):
            raise ApiError(400, f"choice: completion {body.completion_id!r} has {len(choices)} choice(s)",
                           param="choice")
        limit = await self.intake.limit(body.model, engine)
        held = len(choices[body.choice])
        suffix = await self.intake.off_loop(lambda: text_tokens(engine.model, body.prompt, limit=limit,
                                                                param="prompt", add_special=False,
                                                                held=held)) if body.prompt else []
        return await self.runner.run(request, "text", body, engine, choices[body.choice] + suffix, body.max_tokens,
                                     body.logprobs, agent=agent)

    async def pin(self, request: HttpRequest) -> dict[str, Any]:
        body = parse(PinBody, await self.intake.json(request))
        engine = await self.models.engine(request, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        limit = await self.intake.limit(body.model, engine, shifts=False)  # a pin is never shifted
        tokens = await self.intake.off_loop(lambda: completion_prompt(engine.model, body.prompt, limit=limit)
                                            if body.prompt is not None
                                            else chat_prompt(engine.model, body.messages or [], generation=False,
                                                             limit=limit))
        engine_pin, result = await self.runner.pin(request, engine, tokens, body.exact_prefix)
        pin_id = f"pin-{uuid.uuid4().hex}"
        held = self.pool.hold(body.model)  # kept until unpinned: a model with pins is never unloaded
        assert held is not None  # this request holds it too
        self._pins[pin_id] = (engine, engine_pin, held[1])
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

    async def move_agent(self, agent: str, request: HttpRequest) -> dict[str, Any]:
        return await self.models.move_agent(agent, parse(MoveBody, await self.intake.json(request)))

    async def stats(self) -> dict[str, Any]:
        engines = {name: asdict(engine.stats()) for name, engine in self.pool.engines.items()}
        return {**engines, **self.models.stats(), AGENTS_KEY: self.agents.describe()}
