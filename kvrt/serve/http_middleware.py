"""ASGI middleware of kvrt's HTTP front: the API key check, and the per-request record that metrics and logs read.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, which would sit between the
routes and their client's disconnects and streamed bodies.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from kvrt.serve.api_error import ApiError
from kvrt.serve.metrics import RequestRecord


class RequireKey:
    """ASGI middleware: every path but ``open_paths`` needs ``Authorization: Bearer <key>`` (else 401)."""

    def __init__(self, app: Any, key: str, open_paths: frozenset[str]) -> None:
        self.app, self._key, self._open = app, key.encode("utf-8"), open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open:
            refusal = self._refusal(dict(scope["headers"]).get(b"authorization"))
            if refusal is not None:
                response = JSONResponse(refusal.body(), status_code=refusal.status,
                                        headers={"www-authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, header: bytes | None) -> ApiError | None:
        """None when ``header`` carries the key; else the 401 saying whether a key was missing or wrong."""
        scheme, _, given = (header or b"").partition(b" ")
        if header is None or scheme.lower() != b"bearer" or not given.strip():
            message = "no API key: send it as 'Authorization: Bearer <key>'"
        elif hmac.compare_digest(given.strip(), self._key):
            return None
        else:
            message = "the API key in the Authorization header is not this server's (kvrt serve --api-key)"
        return ApiError(401, message, code="invalid_api_key")


def release(record: RequestRecord) -> None:
    """Run and forget ``record``'s releases (its holds on a model), each once."""
    while record.releases:
        record.releases.pop()()


class Observe:
    """ASGI middleware: gives each request a :class:`RequestRecord` (``request.state.kvrt``) for its route
    to fill in, and hands it with the status to ``done(method, path, status, record)`` once the answer
    is sent (a stream's last chunk included). The record's releases run just before the answer's last body
    message goes out (and, for an answer that never got there, after the app returns)."""

    def __init__(self, app: Any, done: Callable[[str, str, int, RequestRecord], None]) -> None:
        self.app, self._done = app, done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord()
        scope.setdefault("state", {})["kvrt"] = record
        status = 500  # what the client gets if the app raises before answering

        async def sending(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                release(record)  # before the client can see the answer end: its next call finds the model free
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            release(record)
            self._done(scope["method"], scope["path"], status, record)


class BodyTooLarge(Exception):
    """A request body over a front's ``max_input_bytes``; ``size`` says how large, as far as it was read (a byte
    count, or "more than N")."""

    def __init__(self, size: str) -> None:
        super().__init__(size)
        self.size = size


async def read_body(request: Any, limit: int) -> bytes:
    """The whole body of ``request`` (a Starlette request), refused (:class:`BodyTooLarge`) as soon as it is known
    to exceed ``limit`` bytes: by its declared length, else while it arrives (nothing past the limit is kept)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"more than {size - len(chunk)}")
        chunks.append(chunk)
    return b"".join(chunks)
