"""The cluster's HTTP entry: Ray Serve's proxy hands it every request; it relays each to a kvrt replica.

:class:`Ingress` reads the body (at most ``max_input_bytes``: a larger one gets the plain server's 413 shape
here, before it is read whole), takes the request's route from it (:func:`kvrt.cluster.affinity.route_of`) and
calls the replicas' deployment handle, whose :class:`kvrt.cluster.router.AffinityRouter` picks the replica.
The answer comes back as the replica's server wrote it: status and headers, then the body, an SSE stream passed
on chunk by chunk as it comes. Everything else (the API key, errors, agents' 400s) is the replica's server's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvrt.cluster.affinity import DEFAULT_PREFIX_CHARS, route_of
from kvrt.cluster.replica import Head, relayed
from kvrt.cluster.router import ROUTE_KWARG
from kvrt.serve.api_error import ApiError
from kvrt.serve.http_intake import DEFAULT_MAX_INPUT_BYTES
from kvrt.serve.http_middleware import BodyTooLarge, read_body


class Ingress:
    """Ray Serve's ingress deployment over the kvrt replicas (see the module docstring)."""

    def __init__(self, replicas: DeploymentHandle, *, prefix_chars: int = DEFAULT_PREFIX_CHARS,
                 max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> None:
        self._replicas = replicas.options(method_name="forward", stream=True)
        self.prefix_chars = prefix_chars
        self.max_input_bytes = max_input_bytes

    async def __call__(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.max_input_bytes)
        except BodyTooLarge as exc:
            error = ApiError(413, f"the request body is {exc.size} bytes; this cluster takes at most "
                                  f"{self.max_input_bytes} (max_input_bytes)", code="request_too_large")
            return JSONResponse(error.body(), status_code=413)
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        # parsing a body of megabytes takes milliseconds: off the loop, where every relayed stream of this ingress runs
        route = await asyncio.to_thread(route_of, request.headers, body, prefix_chars=self.prefix_chars)
        answer: DeploymentResponseGenerator = self._replicas.remote(
            request.method, path, relayed(request.headers.items()), body, **{ROUTE_KWARG: route})
        try:
            head = await answer.__anext__()
        except Exception as exc:  # the replica died or its server refused the connection: nothing was answered
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            error = ApiError(502, f"the kvrt replica failed before answering: {reason}", kind="server_error",
                             code="replica_failed")
            return JSONResponse(error.body(), status_code=502)
        assert isinstance(head, Head)  # forward() yields its head first
        if head.streamed:
            return StreamingResponse(_rest(answer), status_code=head.status, headers=dict(head.headers))
        content = b"".join([chunk async for chunk in answer])
        return Response(content, status_code=head.status, headers=dict(head.headers))


async def _rest(answer: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The body chunks after the head; leaving early (the client went away) cancels the replica's relay."""
    try:
        async for chunk in answer:
            yield chunk
    finally:
        answer.cancel()
