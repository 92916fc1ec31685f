"""A request while the batching engine runs it: its slots, prefill progress and choices.

Only the engine's worker thread touches these objects. A :class:`Live` request
prefills its prompt into its first slot (``slot``) chunk by chunk; its other choices'
slots share each chunk's cells as it lands (``seq_cp``), so ``n`` choices cost one
prefill. Once the prompt is in, every :class:`Choice` samples from the prompt's last
logits row and then decodes one token per engine step in its own slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrt.engine.generation import SequenceStream
from kvrt.engine.requests import Request, RequestStream
from kvrt.engine.sampling import Sampler


@dataclass
class Choice:
    """One output sequence: its slot, sampler, stop logic and what it released so far.

    ``pos`` is the slot's next KV position; ``pending`` the sampled token the next step
    decodes (``None`` while the prompt is still prefilling, or once finished).
    """

    index: int
    slot: int
    sampler: Sampler
    stream: SequenceStream
    pos: int = 0
    pending: int | None = None
    finish_reason: str | None = None
    ended_by: int | None = None  # a sampled token that ended it without being output (eog, a stop token id)

    def release(self) -> str:
        """Text that can go out now (see :meth:`SequenceStream.release`)."""
        return self.stream.release()

    def rest(self) -> str:
        """The text not released yet (at the end)."""
        return self.stream.rest()


@dataclass
class Live:
    """An admitted request (or a pin: prefill only, no choices)."""

    request: Request
    stream: RequestStream
    slot: int
    reused: int
    choices: list[Choice] = field(default_factory=list)
    pin: bool = False
    prefilled: int = 0
    ended: bool = False

    @property
    def prompt(self) -> Sequence[int]:
        return self.request.prompt  # a tuple: Request normalises it

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)

    @property
    def done(self) -> bool:
        """Every choice finished (a pin: its prompt is in)."""
        if self.pin:
            return not self.prefilling
        return all(c.finish_reason is not None for c in self.choices)

    def future_cells(self) -> int:
        """Cells this request may still create: the rest of its prompt and of every running choice."""
        left = len(self.request.prompt) - self.prefilled
        limit = self.request.params.max_tokens
        return left + sum(limit - len(c.stream.tokens) for c in self.choices if c.finish_reason is None)

    @property
    def slots(self) -> list[int]:
        return [self.slot] if self.pin else [c.slot for c in self.choices]
