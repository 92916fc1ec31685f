"""The HTTP front's waker: the engine's thread sets asyncio events of the server's loop, one loop wake-up for all
the events due since the last one (a step streams a token to every running request)."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("fastapi")

from kvrt.serve.sse import Waker  # noqa: E402


def test_events_set_from_another_thread_wake_the_loop_once_and_are_all_set():
    loop = asyncio.new_event_loop()
    try:
        scheduled = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            scheduled.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        waker = Waker(loop)
        flags = [asyncio.Event() for _ in range(40)]
        setter = threading.Thread(target=lambda: [waker.set_soon(flag) for flag in flags])
        setter.start()
        setter.join()  # the loop is not running: everything due waits for one wake
        assert len(scheduled) == 1 and not any(flag.is_set() for flag in flags)
        loop.run_until_complete(asyncio.sleep(0))
        assert all(flag.is_set() for flag in flags)
        waker.set_soon(flags[0])  # after a wake, the next event schedules a new one
        assert len(scheduled) == 2
    finally:
        loop.close()
    scheduled.clear()
    waker.set_soon(asyncio.Event())  # a closed loop: nobody listens, nothing raises, nothing is scheduled
    assert scheduled == []


def test_many_threads_setting_events_while_the_loop_runs_lose_none():
    async def main() -> list[asyncio.Event]:
        waker = Waker(asyncio.get_running_loop())
        flags = [asyncio.Event() for _ in range(400)]
        threads = [threading.Thread(target=lambda part=flags[i::4]: [waker.set_soon(f) for f in part])
                   for i in range(4)]
        for thread in threads:
            thread.start()
        await asyncio.wait_for(asyncio.gather(*(flag.wait() for flag in flags)), 30)
        for thread in threads:
            thread.join()
        return flags

    assert all(flag.is_set() for flag in asyncio.run(main()))



def test_a_paced_stream_sends_a_keep_alive_only_when_the_interval_passes_without_an_event():
    """``Bridge.paced``: ``None`` (a keep-alive) once ``keepalive_s`` passes without an event, events as they come,
    and no keep-alive for a wake whose event was already taken (the engine pushes, then notifies: the wake may
    come after the reader took the event; here a notify without an event stands for it). The engine's side pushes
    from another thread, as in the server."""
    from kvrt.runtime.requests import Request, RequestEnd, RequestStream, TokenEvent
    from kvrt.serve.sse import Bridge

    a, b, end = TokenEvent(0, 7, "a"), TokenEvent(0, 8, "b"), RequestEnd(3, 0, 2)

    async def read() -> list[object]:
        bridge = Bridge(Waker(asyncio.get_running_loop()))
        stream = RequestStream("r", Request([1, 2, 3]), notify=bridge.notify)
        seen: list[object] = []
        async for event in bridge.paced(stream, 0.5):
            seen.append(event)
            if event is None:
                threading.Thread(target=stream.push, args=(a,)).start()
            elif event == a:
                bridge.notify()  # a wake with nothing new
                threading.Timer(0.01, stream.push, (b,)).start()  # well within the interval
            elif event == b:
                threading.Thread(target=stream.push, args=(end,)).start()
        return seen

    assert asyncio.run(asyncio.wait_for(read(), 30)) == [None, a, b, end]
