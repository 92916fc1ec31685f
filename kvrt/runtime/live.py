"""A request while the batching engine runs it: its slots, prefill progress and choices.

Only the engine's worker thread touches these objects. A :class:`Live` request
prefills its prompt into its first slot (``slot``) chunk by chunk; its other choices'
slots share each chunk's cells as it lands (``seq_cp``), so ``n`` choices cost one
prefill. Once the prompt is in, every :class:`Choice` samples from the prompt's last
logits row and then decodes one token per engine step in its own slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvrt.engine.context import Context
from kvrt.engine.generation import SequenceStream
from kvrt.engine.sampling import Sampler
from kvrt.errors import KvrtError
from kvrt.runtime.prefix_cache import PrefixCache
from kvrt.runtime.requests import ChoiceEnd, Request, RequestEnd, RequestStream, TokenEvent, token_logprobs

log = logging.getLogger(__name__)


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
    reused: int  # prompt positions taken from the cache, of which
    restored: int = 0  # brought back from the host tier
    choices: list[Choice] = field(default_factory=list)
    pin: bool = False
    prefilled: int = 0
    ended: bool = False
    turnaround: float | None = None  # a next turn: seconds from its history's release (in a slot or copy) to arrival

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

    def finish(self, choice: Choice, reason: str, cache: PrefixCache) -> None:
        """One choice is over: its slot's cells stay cached (its request's agent's), its sampler is freed, its end
        is streamed."""
        choice.finish_reason, choice.pending = reason, None
        choice.sampler.close()
        cache.release(choice.slot, owner=self.request.agent)
        self.stream.push(ChoiceEnd(choice.index, reason, choice.stream.text, tuple(choice.stream.tokens),
                                   choice.rest(), choice.ended_by))

    def accept(self, choice: Choice, token: int, logits: Callable[[], np.ndarray], cache: PrefixCache) -> None:
        """``choice`` sampled ``token``: it is streamed and decoded next, or it ends the choice (a stop token
        id, end of generation, a stop string or ``max_tokens``). ``logits`` gives the row it was sampled from,
        read only when the request asked for logprobs."""
        if token in self.request.stop_token_ids:
            choice.ended_by = token
            self.finish(choice, "stop", cache)
            return
        k = self.request.logprobs
        logprob = token_logprobs(logits(), token, k) if k is not None else None
        done = choice.stream.accept(token)
        choice.ended_by = choice.stream.eog_token
        if choice.stream.finish_reason != "eog":
            self.stream.push(TokenEvent(choice.index, token, choice.release(), logprob))
        if done:
            self.finish(choice, choice.stream.finish_reason or "length", cache)
        else:
            choice.pending = token

    def finish_all(self, reason: str, cache: PrefixCache) -> None:
        """Every choice still running is over (a pin's slot is released)."""
        if self.pin:
            cache.release(self.slot)
        for choice in self.choices:
            if choice.finish_reason is None:
                self.finish(choice, reason, cache)

    def end_event(self, error: KvrtError | None) -> RequestEnd:
        """The request's last event: its token counts, and the error that ended it."""
        completion = sum(len(c.stream.tokens) for c in self.choices)
        return RequestEnd(len(self.prompt), self.reused, completion, error)

    def hand_state(self, ctx: Context, cache: PrefixCache) -> None:
        """``Request.at_end`` of a request of one choice that finished normally gets its slot, settled and holding
        exactly the tokens given, before the request's end is pushed (see :class:`Request`); an exception it
        raises is logged."""
        at_end = self.request.at_end
        choice = self.choices[0] if len(self.choices) == 1 and not self.pin else None
        if (at_end is None or choice is None or choice.finish_reason not in ("eog", "stop", "length")
                or cache.unsettled(choice.slot)):
            return
        try:
            at_end(ctx, choice.slot, tuple(cache.tokens(choice.slot)))
        except Exception:
            log.exception("the at_end hook of request %s failed", self.stream.id)

    def pickers(self, choice: Choice | None) -> list[Choice]:
        """The choices that sample a row: a decode token's own choice, or every choice once the prompt is in."""
        if choice is not None:
            return [choice]
        return [] if self.prefilling or self.pin else self.choices
