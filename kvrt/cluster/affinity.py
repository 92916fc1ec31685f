"""Where a request should go: its route (agent, prompt prefix, or anywhere) and the replicas ranked for it.

An agent's history lives in the engine of the replica that served its last turn, so an agent's requests
are *pinned*: the same agent id (the ``X-Kvrt-Agent`` header, else the body's ``user``, as
:func:`kvrt.serve.http_agents.agent_of` reads them) always goes to the same replica while that replica is alive.
An anonymous request that carries a prompt goes first to the replica its prompt's opening hashes to, so
requests that share a document (a fan-out) find it cached together; that replica full, any other may take it.
Anything else (``GET`` routes, a body that is not JSON) may go anywhere: the least loaded replica.

Ranking is rendezvous (highest random weight) hashing: each replica scores ``blake2b(key, replica id)`` and
the highest wins. Invariant: when a replica leaves, only the keys it won move (each to its runner-up); when one
joins, only the keys it now wins move to it. The hash is keyed by nothing per-process, so every router (each
ingress replica, each process) ranks alike. An agent id that is not valid routes as anonymous: the replica then
answers it with the plain server's 400.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrt.errors import KvrtError
from kvrt.serve.http_agents import HEADER
from kvrt.serve.results import check_agent_id

DEFAULT_PREFIX_CHARS = 1024  # about 250 tokens of English: past a system prompt, inside a shared document
PROMPT_FIELDS = ("messages", "prompt", "input")  # chat, completions (and pins, fork), responses


@dataclass(frozen=True)
class Route:
    """A request's routing key and how strictly it holds: ``key`` None goes to the least loaded replica; otherwise
    ``pinned`` sends it only to the key's replica (waiting while that one is full), else to the key's replica
    first and to the least loaded other when it is full."""

    key: str | None = None
    pinned: bool = False


ANYWHERE = Route()


def route_of(headers: Mapping[str, str], body: bytes, *, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> Route:
    """The route of a request with ``headers`` (names lower case, as ASGI gives them) and raw ``body``: its agent's,
    else its prompt's first ``prefix_chars`` characters' (with the model's name), else anywhere."""
    fields = _json_object(body)
    agent = headers.get(HEADER.lower())
    if agent is None:
        agent = fields.get("user")
    if agent is not None:
        try:
            return Route(f"agent\0{check_agent_id(agent)}", pinned=True)
        except KvrtError:
            return ANYWHERE  # refused by the replica, with the plain server's 400
    prompt = next((fields[name] for name in PROMPT_FIELDS if fields.get(name)), None)
    if prompt is None:
        return ANYWHERE
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, sort_keys=True)
    return Route(f"prefix\0{fields.get('model')}\0{text[:prefix_chars]}")


def _json_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object, or empty (not JSON, or not an object: the replica refuses it, naming why)."""
    try:
        value = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def ranked(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` (ids) best first for ``key`` by rendezvous hashing (see the module docstring)."""
    return sorted(replicas, key=lambda replica: _score(key, replica), reverse=True)


def _score(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=16).digest()
