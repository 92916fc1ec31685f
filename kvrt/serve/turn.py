"""One queued request of an agent in the per-agent scheduler (:mod:`kvrt.serve.scheduler`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvrt.engine.generation import GenerationParams
from kvrt.serve.results import DecodeResult
from kvrt.serve.service import TextFn


@dataclass
class Turn:
    """A queued request of one agent: its prompt (text or token ids), when to stop, where its text goes.

    ``deadline`` is a :func:`time.monotonic` instant: a turn not started by then ends with
    ``deadline``, a running one stops at its next token with ``deadline``; so does a
    cancelled one (``cancelled``), keeping what it generated.
    """

    prompt: str | Sequence[int]
    params: GenerationParams
    future: Future[DecodeResult]
    deadline: float | None = None
    on_text: TextFn | None = None
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by Scheduler.cancel while the turn runs; read between two tokens

    def end_reason(self) -> str | None:
        """Why the running turn must stop now, if it must."""
        if self.cancelled:
            return "cancelled"
        return "deadline" if self.deadline is not None and time.monotonic() >= self.deadline else None
