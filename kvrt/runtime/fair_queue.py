"""The batching engine's waiting requests, admitted round robin by agent.

A request may name its agent (:attr:`kvrt.runtime.requests.Request.agent`; ``None``:
anonymous, and all anonymous requests are one group). The request admitted next is the
first waiting one of the agent (or group) whose last admission is the oldest, an agent
never admitted counting as oldest of all: an agent that queued many requests gets one
turn in each round, never all of them before the others' first. Among one agent's
requests it is first come, first served, so with no agents named the queue is the FIFO
it always was.

Invariant: :meth:`FairQueue.head` is a pure function of the waiting requests and the
admission history, so the engine may ask for it, decide to wait, and get the same one
on the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvrt.runtime.admission import Pending

MAX_REMEMBERED = 4096  # agents whose last admission is kept; one forgotten counts as never admitted


class FairQueue:
    """Waiting requests (see the module docstring); the engine holds its lock around every call."""

    def __init__(self) -> None:
        self._items: deque[Pending] = deque()
        self._admitted: dict[str | None, int] = {}  # agent -> the tick of its last admission
        self._tick = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Pending]:
        return iter(self._items)

    def append(self, pending: Pending) -> None:
        self._items.append(pending)

    def remove(self, pending: Pending) -> None:
        """Take ``pending`` out without counting it as admitted (cancelled, expired)."""
        self._items.remove(pending)

    def clear(self) -> None:
        self._items.clear()

    def head(self) -> Pending | None:
        """The request to admit next: the first one of the agent admitted least recently (None: nothing waits)."""
        best, best_tick = None, 0
        for pending in self._items:
            tick = self._admitted.get(pending.stream.request.agent, -1)
            if best is None or tick < best_tick:
                best, best_tick = pending, tick
        return best

    def take(self, pending: Pending) -> None:
        """Take ``pending`` out as admitted (or refused at admission): its agent's turn is used."""
        self._items.remove(pending)
        agent = pending.stream.request.agent
        self._admitted.pop(agent, None)  # re-inserted last: the dict stays in admission order
        self._admitted[agent] = self._tick
        self._tick += 1
        while len(self._admitted) > MAX_REMEMBERED:
            del self._admitted[next(iter(self._admitted))]
