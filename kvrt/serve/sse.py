"""Engine events to asyncio tasks (one loop wake-up for many), and the pieces of a server-sent-events stream
(data lines, keep-alives)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from kvrt.runtime.requests import Event, RequestEnd, RequestStream

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see the connection is alive


class Waker:
    """Sets asyncio events of one loop from the engine's thread, waking the loop once for all the events due
    since its last wake: a step that streams a token to each of N requests costs one wake-up of the loop (one
    write to its self-pipe), not N.

    Invariant: a wake is scheduled whenever ``_due`` is not empty (the first event added schedules it; the wake
    empties the list under the lock before setting the events).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._due: list[asyncio.Event] = []

    def set_soon(self, flag: asyncio.Event) -> None:
        if self.loop.is_closed():  # nobody listens any more: keep nothing for it
            return
        with self._lock:
            self._due.append(flag)
            if len(self._due) > 1:  # a wake is already scheduled
                return
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # closed since the check above
            with self._lock:
                self._due.clear()

    def _wake(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for flag in due:
            flag.set()


class Bridge:
    """Wakes one asyncio task from the engine's thread whenever its request has new events."""

    def __init__(self, waker: Waker) -> None:
        self._waker = waker
        self._flag = asyncio.Event()
        self._keepalive_due = False

    def notify(self) -> None:
        self._waker.set_soon(self._flag)

    async def events(self, stream: RequestStream) -> AsyncIterator[Event]:
        """``stream``'s events as they come, its :class:`RequestEnd` last."""
        async for event in self.paced(stream, None):
            if event is not None:
                yield event

    async def paced(self, stream: RequestStream, keepalive_s: float | None) -> AsyncIterator[Event | None]:
        """:meth:`events`, and ``None`` each time ``keepalive_s`` seconds pass without one (a request waiting in
        the queue, or before its first token): the stream sends a keep-alive then.

        Why a timer and not a timeout around each wait: this runs once for every token of every stream, and a
        timeout costs a task and a waiter each time (``asyncio.wait``), a timer one handle."""
        loop = asyncio.get_running_loop()
        while True:
            self._flag.clear()
            while (event := stream.poll()) is not None:
                yield event
                if isinstance(event, RequestEnd):
                    return
            if keepalive_s is None:
                await self._flag.wait()
                continue
            self._keepalive_due = False  # the timer's mark: a notify for an event already taken wakes the wait too
            timer = loop.call_later(keepalive_s, self._time_out)
            try:
                await self._flag.wait()
            finally:
                timer.cancel()
            if self._keepalive_due:
                yield None

    def _time_out(self) -> None:
        self._keepalive_due = True
        self._flag.set()


def sse(obj: Mapping[str, Any], event: str | None = None) -> str:
    """One SSE event carrying ``obj`` as compact JSON (``event``: its SSE event name, as the Responses API sends)."""
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {json.dumps(obj, separators=(',', ':'))}\n\n"
