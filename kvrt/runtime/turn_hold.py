"""How long a finished sequence's slot is held for its conversation's next turn (``EngineConfig.hold_s``).

A hold keeps a waiting request from evicting the history of an agent whose next turn is on its way
(:func:`kvrt.runtime.admission.place`). How long that way is depends on the clients and the host, not on
the engine: a few tens of milliseconds for an agent on a lightly loaded machine; hundreds for the last of
thirty agents whose turns ended in the same step, on two cores shared with their clients. A fixed hold
either lets the late ones lose their histories or makes new requests wait for agents that never return.

:class:`TurnHold` measures instead. Each next turn that finds its history, in its slot or as the host
tier's copy of it, is a sample: the time from its slot's release to the turn's arrival in the queue. The
hold is the configured one, or :data:`MARGIN` times the longest of the last ``window`` samples when that is
longer, at most :data:`CAP_S`. Turns arriving late raise it for the turns behind them: those within the hold,
and those after it whose history the host tier kept, so a hold too short for the traffic learns from the
turns it failed. A turn whose history was lost altogether is no sample (nothing says whose it was), nor is
one that came back later than :data:`CAP_S`: no hold could have covered it, and an agent that waited on a
tool or a person says nothing about how late a turn already on its way may be (counted, such agents would
keep the hold at its cap, and every new request waiting on it). Where no agent comes back in time, no sample
is taken, and the configured hold stays. A configured hold of 0 turns holds off.
"""

from __future__ import annotations

from collections import deque

MARGIN = 2.0  # the hold over the longest recent turnaround: room for the next turn to be a little later
CAP_S = 1.0  # the longest the measured hold may grow to, and the latest turn that is a sample (a longer hold_s is kept)


class TurnHold:
    """The hold in force (:attr:`seconds`): ``floor_s`` or what the recent turnarounds ask for."""

    def __init__(self, floor_s: float, window: int) -> None:
        self.floor_s = floor_s
        self._turnarounds: deque[float] = deque(maxlen=max(1, window))

    def observe(self, turnaround_s: float) -> None:
        """A next turn came ``turnaround_s`` seconds after its slot was released, and found its history (a sample
        if no longer than :data:`CAP_S`)."""
        if turnaround_s <= CAP_S:
            self._turnarounds.append(turnaround_s)

    @property
    def seconds(self) -> float:
        if not self.floor_s or not self._turnarounds:
            return self.floor_s
        return max(self.floor_s, min(MARGIN * max(self._turnarounds), CAP_S))
