"""The HTTP front's record of recent requests: what the latest ones left behind, by id, for a later request to name.

``/v1/kvrt/fork`` continues a remembered completion's exact tokens (:mod:`kvrt.serve.http_runner` remembers them)
and ``/v1/responses`` chains from, returns or deletes a stored response (:mod:`kvrt.serve.responses_routes`); each
looks its entry up here. Why a bound: a server answers requests for as long as it runs, and an id a client may name
again must not keep its tokens forever. Invariant: a record never holds more than ``limit`` entries; adding one past
that drops the oldest added first (``OpenAIServer(remember=...)`` is every record's limit).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

_T = TypeVar("_T")


class Recent(Generic[_T]):
    """The latest ``limit`` entries added, by key."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: OrderedDict[str, _T] = OrderedDict()

    def add(self, key: str, value: _T) -> None:
        """``key`` -> ``value``, the oldest entries dropped beyond ``limit``."""
        self._kept[key] = value
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def get(self, key: str) -> _T | None:
        return self._kept.get(key)

    def remove(self, key: str) -> None:
        del self._kept[key]
