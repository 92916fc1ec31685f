"""What a client asks the batching engine for, and the thread-safe stream its answer arrives on.

A :class:`Request` is prompt tokens plus :class:`kvrt.engine.generation.GenerationParams`
(max_tokens, stop strings, sampling) and the engine's extras: ``n`` choices, stop token
ids, log-probabilities, a deadline. :meth:`kvrt.runtime.batching.Engine.submit` returns a
:class:`RequestStream`: the engine's worker thread pushes :class:`TokenEvent` s as tokens
are sampled, one :class:`ChoiceEnd` per choice and a final :class:`RequestEnd`; any
thread reads them (blocking ``get``, iteration, or :meth:`RequestStream.result`), and an
asyncio caller passes ``notify`` to be woken without blocking a thread.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams
from kvrt.errors import KvrtError

MAX_LOGPROBS = 20
"""The most alternatives a token's log-probabilities list (OpenAI's ``top_logprobs`` bound)."""

FINISH_REASONS = ("eog", "stop", "length", "cancelled", "deadline", "error")


class EngineError(KvrtError):
    """The batching engine refused or failed a request."""


class RequestTooLarge(EngineError):
    """A request that can never fit the engine's context: too many cells, choices or slots."""


class EngineOverloaded(EngineError):
    """The engine's waiting queue is full; try again later."""


class EngineClosed(EngineError):
    """The engine was closed before or while the request ran."""


class AgentBusy(EngineError):
    """An agent's history cannot be handed over while a request of it is queued or running."""


@dataclass(frozen=True)
class Request:
    """One completion request for the engine.

    ``n`` choices are forked from one prefill of ``prompt`` (choice ``i`` samples with
    seed ``sampling.seed + i``). A sampled token in ``stop_token_ids`` ends its choice
    with ``stop`` and is not part of the output. ``logprobs=k`` reports every sampled
    token's log-probability and its ``k`` most likely alternatives. ``deadline`` is a
    :func:`time.monotonic` instant after which the request ends with ``deadline``.
    ``after_chunk(p0, p1)`` runs on the engine's thread after each decode that put
    prompt positions ``[p0, p1)`` into the request's first sequence. ``exact``: the prompt's
    logits are the ones a cold prefill of the same prompt by the same engine gives, bit for bit
    (in the split KV layout): a cached prefix is reused only as far as a cold prefill would have
    computed it the same way, and the rest is prefilled in steps of its own (see
    :func:`kvrt.runtime.admission.place`). ``agent`` names the conversation the request continues (``None``:
    anonymous): waiting requests are admitted round robin by agent (:mod:`kvrt.runtime.fair_queue`), and the
    slot it leaves cached is that agent's, evicted after anonymous prefixes. ``at_end(ctx, slot, tokens)`` runs
    on the engine's thread when a request of one choice finished without error (eog, stop, length), before its
    :class:`RequestEnd` is pushed: ``slot`` of ``ctx`` then holds the KV of exactly ``tokens`` (prompt and output
    but the last sampled token), so a caller can copy the sequence state out (e.g. to save an agent); an
    exception it raises is logged and the request still ends normally.
    """

    prompt: Sequence[int]
    params: GenerationParams = field(default_factory=GenerationParams)
    n: int = 1
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    deadline: float | None = None
    after_chunk: Callable[[int, int], None] | None = None
    exact: bool = False
    agent: str | None = None
    at_end: Callable[[Context, int, tuple[int, ...]], None] | None = None
    prompt_array: np.ndarray = field(init=False, repr=False, compare=False)  # the prompt as int64, for prefix lookups

    def __post_init__(self) -> None:
        tokens = tuple(map(int, self.prompt))
        if not tokens:
            raise EngineError("a request needs at least one prompt token")
        object.__setattr__(self, "prompt", tokens)
        object.__setattr__(self, "prompt_array", np.array(tokens, dtype=np.int64))
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise EngineError(f"n must be an integer >= 1, got {self.n!r}")
        if self.agent is not None and not isinstance(self.agent, str):
            raise EngineError(f"agent must be a string or None, got {self.agent!r}")
        if not isinstance(self.exact, bool):
            raise EngineError(f"exact must be True or False, got {self.exact!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise EngineError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def cells(self) -> int:
        """Cells the request needs without any cached prefix: its prompt and every choice's tokens."""
        return len(self.prompt) + self.n * self.params.max_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (float64 log-softmax of its logits row)
    and the ``top`` most likely tokens with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """Log-softmax of one logits row in float64: the chosen token's value and the ``k`` largest."""
    x = logits.astype(np.float64)
    peak = float(x.max())
    logz = peak + math.log(float(np.exp(x - peak).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        best = np.argpartition(-x, k - 1)[:k] if k < x.size else np.arange(x.size)
        best = best[np.lexsort((best, -x[best]))]  # largest first, lower id first on ties
        top = tuple((int(i), float(x[i] - logz)) for i in best)
    return TokenLogprob(token, float(x[token] - logz), top)


@dataclass(frozen=True)
class TokenEvent:
    """Choice ``index`` sampled ``token``; ``text`` is the output text it released (may be empty:
    a partial UTF-8 character, or text that could still turn out to start a stop string)."""

    index: int
    token: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class ChoiceEnd:
    """Choice ``index`` finished: why, its whole text and tokens (stop strings and stop tokens cut).

    ``rest`` is the end of ``text`` that no :class:`TokenEvent` released (held back, or
    flushed at the end): the choice's TokenEvent texts followed by ``rest`` are ``text``.
    ``ended_by`` is the sampled token that ended the choice and is not in ``tokens`` (an
    end-of-generation token or one of ``stop_token_ids``), so ``tokens`` + ``ended_by`` is
    everything the model chose.
    """

    index: int
    finish_reason: str
    text: str
    tokens: tuple[int, ...]
    rest: str = ""
    ended_by: int | None = None


@dataclass(frozen=True)
class RequestEnd:
    """The request is over. ``cached_tokens`` of the prompt came from the prefix cache, the rest were
    prefilled; ``error`` is set when it failed (then choices may have ended with ``error``)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: KvrtError | None = None


Event = TokenEvent | ChoiceEnd | RequestEnd


@dataclass
class ChoiceResult:
    """Everything one choice produced."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RequestResult:
    """A whole request's outcome, collected from its stream."""

    choices: list[ChoiceResult]
    end: RequestEnd


class RequestStream:
    """The events of one request, pushed by the engine's thread and read by any other.

    ``notify`` (optional) is called on the engine's thread after every push, e.g. to wake
    an asyncio loop with ``loop.call_soon_threadsafe``; it must not block.
    """

    def __init__(self, request_id: str, request: Request, *, notify: Callable[[], None] | None = None,
                 on_cancel: Callable[[], None] | None = None) -> None:
        self.id = request_id
        self.request = request
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._notify = notify
        self._on_cancel = on_cancel
        self._cancelled = threading.Event()

    # -- the engine's side ------------------------------------------------------------
    def push(self, event: Event) -> None:
        self._events.put(event)
        if self._notify is not None:
            self._notify()

    # -- the reader's side ------------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the engine to stop this request (its choices end with ``cancelled``); harmless when over."""
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel()

    def get(self, timeout: float | None = None) -> Event:
        """The next event; raises :class:`TimeoutError` when none came within ``timeout`` seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.id}: no event within {timeout} s") from None

    def poll(self) -> Event | None:
        """The next event if one is waiting, else ``None`` (never blocks)."""
        try:
            return self._events.get_nowait()
        except queue.Empty:
            return None

    def __iter__(self) -> Iterator[Event]:
        """Every event up to and including the :class:`RequestEnd` (blocking)."""
        while True:
            event = self.get()
            yield event
            if isinstance(event, RequestEnd):
                return

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the whole request (``timeout`` bounds each wait for the next event).

        Raises the request's error when it failed.
        """
        collector = ResultCollector(self.request.n)
        while (result := collector.add(self.get(timeout))) is None:
            pass
        if result.end.error is not None:
            raise result.end.error
        return result


class ResultCollector:
    """Folds a request's events, in order, into its :class:`RequestResult`."""

    def __init__(self, n: int) -> None:
        self.choices = [ChoiceResult() for _ in range(n)]

    def add(self, event: Event) -> RequestResult | None:
        """Take one event; returns the result once ``event`` is the :class:`RequestEnd`."""
        if isinstance(event, TokenEvent):
            if event.logprob is not None:
                self.choices[event.index].logprobs.append(event.logprob)
        elif isinstance(event, ChoiceEnd):
            done = self.choices[event.index]
            done.text, done.tokens, done.finish_reason = event.text, list(event.tokens), event.finish_reason
        else:
            return RequestResult(self.choices, event)
        return None


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started and its state now (read without stopping the worker:
    exact whenever the engine is idle)."""

    steps: int
    prefilled_tokens: int  # prompt tokens decoded
    reused_tokens: int  # prompt tokens taken from the prefix cache instead
    restored_tokens: int  # of which restored from host copies of evicted slots (EngineConfig.host_bytes)
    decoded_tokens: int  # sampled tokens decoded
    host_kept: int  # evicted slots copied to the host tier (EngineConfig.host_bytes)
    host_keep_s: float  # seconds those copies took (inside admission: a slot is copied as it is evicted)
    busy_s: float  # wall time of the steps that decoded a batch, of which:
    decode_s: float  # from llama_decode's call until its outputs were ready (bookkeeping runs under it)
    admit_s: float  # commands, deadlines and admission of waiting requests
    fill_s: float  # filling the batch
    sample_s: float  # sampling and streaming the tokens out
    host_cpu_s: float  # the worker's CPU time in admit, fill and sample: the rest of their time it waited (GIL)
    queued: int
    active: int
    used_cells: int
    n_cells: int
    slots: tuple[str, ...]
    kv_layout: str  # "split" (a KV stream per slot) or "unified" (one pool), see EngineConfig.kv_layout
    slot_cells: int  # the most one slot can hold in that layout
    relayouts: int  # times the context was recreated in the other layout (kv_layout "auto")
    relayout_s: float = 0.0  # seconds those recreations took (the worker decodes nothing meanwhile)
    host_dropped: int = 0  # host tier entries dropped (least recently used out for room, or held whole by a newer one)
    sampled_on_device: int = 0  # sampled tokens picked in the decode's graph (EngineConfig.backend_sampling)
    sampler_switches: int = 0  # slots turned to or from that (each makes llama.cpp reserve its graphs again)
    micro_batches: int = 0  # llama.cpp's micro-batches of the steps' batches (kvrt.engine.micro_batches): each
    # reads every weight once, so micro_batches / steps above 1 is a GPU step's cost growing
    hold_s: float = 0.0  # the hold in force for a finished turn's slot: EngineConfig.hold_s or as measured
    # (kvrt.runtime.turn_hold)
