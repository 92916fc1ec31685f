"""Admission for the batching engine: its limits, what can never fit, and slots for what fits now.

:func:`check_fits` runs on the submitting thread before anything is allocated and
refuses (:class:`RequestTooLarge`) what no state of the engine could hold.
:func:`place` runs on the worker: it finds the longest prefix any slot holds, decides
whether slots and cells are free now (``None``: wait), and if so claims the slots
(a request that extends all of a cached slot continues in that slot), shares the
prefix with ``seq_cp`` and evicts least recently used cached prefixes
until the request's worst case fits beside what running requests may still write.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvrt.engine.context import ContextParams
from kvrt.engine.generation import SequenceStream
from kvrt.engine.live import Choice, Live
from kvrt.engine.model import Model
from kvrt.engine.prefix_cache import PrefixCache
from kvrt.engine.requests import ChoiceEnd, EngineError, Request, RequestEnd, RequestStream, RequestTooLarge
from kvrt.engine.sampling import Sampler
from kvrt.errors import KvrtError

LLAMA_MAX_SEQ = 256
WAIT_FOR_SHARE = 32  # prompt tokens another request is prefilling that are worth waiting a step or two for


@dataclass(frozen=True)
class EngineConfig:
    """The engine's context and scheduling limits.

    ``n_ctx`` cells are shared by all ``n_seq_max`` slots; ``n_batch`` bounds the tokens
    of one step (every decoding choice takes one, so it must be >= ``n_seq_max``);
    ``prefill_chunk`` bounds one request's prompt tokens per step; ``max_queue`` the
    requests waiting for admission before :class:`kvrt.engine.requests.EngineOverloaded`.
    """

    n_ctx: int = 4096
    n_seq_max: int = 8
    n_batch: int = 512
    prefill_chunk: int = 256
    max_queue: int = 64
    n_threads: int | None = None
    flash_attn: str = "auto"
    host_bytes: int = 0  # host copies of evicted slots (kvrt.engine.host_tier); 0: evicted prefixes are recomputed

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_seq_max", "n_batch", "prefill_chunk", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.host_bytes, bool) or not isinstance(self.host_bytes, int) or self.host_bytes < 0:
            raise EngineError(f"EngineConfig.host_bytes must be an integer >= 0, got {self.host_bytes!r}")
        if self.n_seq_max > LLAMA_MAX_SEQ:
            raise EngineError(f"n_seq_max={self.n_seq_max} exceeds llama.cpp's {LLAMA_MAX_SEQ} sequences")
        if self.n_batch < self.n_seq_max:
            raise EngineError(f"n_batch ({self.n_batch}) must be >= n_seq_max ({self.n_seq_max}): every decoding "
                              "sequence puts one token into each step's batch")

    def context_params(self) -> ContextParams:
        return ContextParams(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=min(self.n_batch, 512),
                             n_seq_max=self.n_seq_max, kv_unified=True, n_threads=self.n_threads,
                             flash_attn=self.flash_attn)


@dataclass
class Pending:
    """A submitted request waiting for admission (a pin has no samplers)."""

    stream: RequestStream
    samplers: list[Sampler]
    pin: bool = False

    def end(self, reason: str, error: KvrtError | None = None) -> None:
        """It never ran: its samplers are freed, every choice ends empty with ``reason``, then the request."""
        for sampler in self.samplers:
            sampler.close()
        request = self.stream.request
        for i in range(0 if self.pin else request.n):
            self.stream.push(ChoiceEnd(i, reason, "", ()))
        self.stream.push(RequestEnd(len(request.prompt), 0, 0, error))


def check_tokens(request: Request, n_vocab: int) -> None:
    prompt = np.asarray(request.prompt, dtype=np.int64)
    bad = np.flatnonzero((prompt < 0) | (prompt >= n_vocab))
    if bad.size:
        raise EngineError(f"prompt token {int(prompt[bad[0]])} at position {int(bad[0])} is outside the "
                          f"vocabulary [0, {n_vocab})")


def check_fits(request: Request, n_cells: int, n_slots: int, n_vocab: int) -> None:
    """Refuse what no state of the engine could run: too many cells, choices or unknown tokens."""
    n, limit, prompt = request.n, request.params.max_tokens, len(request.prompt)
    if prompt + limit > n_cells:
        raise RequestTooLarge(f"prompt ({prompt} tokens) + max_tokens ({limit}) = {prompt + limit} exceeds "
                              f"the context's {n_cells} cells")
    if request.cells > n_cells:
        raise RequestTooLarge(f"prompt ({prompt} tokens) + n ({n}) x max_tokens ({limit}) = {request.cells} "
                              f"cells exceed the context's {n_cells}")
    if n > n_slots:
        raise RequestTooLarge(f"n={n} choices need {n} sequence slots; the engine has {n_slots}")
    check_tokens(request, n_vocab)


def place(cache: PrefixCache, model: Model, pending: Pending, reserved: int, coming: int = 0) -> Live | None:
    """Slots and the cached prefix for ``pending``; ``None`` while they are not free yet.

    ``reserved`` is the cells running requests may still write. ``coming`` is the longest
    prefix ``pending`` shares with a prompt still being prefilled: when it is at least
    :data:`WAIT_FOR_SHARE` tokens longer than what is cached now, ``pending`` waits for
    it (a step or two) and then shares those cells instead of prefilling them again, so
    many agents starting with one preamble prefill it once. Raises
    :class:`RequestTooLarge` when pinned prefixes leave too few slots or cells for good.
    """
    request = pending.stream.request
    prompt = request.prompt
    limit = len(prompt) - (0 if pending.pin else 1)  # a choice samples the last prompt token's logits
    src, m = cache.longest_prefix(prompt)
    m = min(m, limit)
    entry, h = cache.host_prefix(prompt)
    h = min(h, limit)
    if min(coming, len(prompt) - 1) >= max(m, h) + WAIT_FOR_SHARE:
        return None
    if entry is not None and h > m:  # a host copy holds more: restore it into a new slot (its cells are new)
        src, m = None, 0
    else:
        entry = None
    src = src if m > 0 else None
    new_cells = len(prompt) - m + (0 if pending.pin else request.n * request.params.max_tokens)
    slots_needed = 1 if pending.pin else request.n
    pinned = len(cache.pinned)
    if slots_needed + pinned + (1 if pending.pin else 0) > cache.n_slots:
        raise RequestTooLarge(f"{slots_needed} slot(s) needed, {pinned} of the engine's {cache.n_slots} "
                              f"are pinned{' (a pin must leave one slot unpinned)' if pending.pin else ''}")
    own = new_cells + (0 if src in cache.pinned else m)  # a pinned source's cells are the pin's
    beside_pins = cache.n_cells - cache.pinned_cells()
    if own > beside_pins:
        raise RequestTooLarge(f"the request needs {own} cells; {beside_pins} of the context's "
                              f"{cache.n_cells} are not held by pinned prefixes")
    free = cache.cells_if_evicted(keep=(src, m) if src is not None else None)
    if cache.available_slots() < slots_needed or free - reserved < new_cells:
        return None
    extends = (src is not None and cache.state[src] == "cached" and src not in cache.pinned
               and len(cache.tokens(src)) == m)  # the request continues all of it: a conversation's next turn
    first = None if extends else cache.claim(avoid=src)
    if first is None:  # continue in the source slot itself (no copy, and no other slot's cells evicted)
        assert src is not None
        first = src
        cache.take_over(src, m)
    elif src is not None:
        cache.copy_prefix(src, first, 0, m)
    elif entry is not None:
        cache.evict_until(new_cells + reserved)  # the restore writes new cells: make them free first
        if cache.restore(first, entry, h):
            m = h
    live = Live(request, pending.stream, first, reused=m, pin=pending.pin, prefilled=m)
    for i, sampler in enumerate(pending.samplers):
        slot = first if i == 0 else cache.claim()
        assert slot is not None  # available_slots() counted them
        if i > 0:
            cache.copy_prefix(first, slot, 0, m)
        live.choices.append(Choice(i, slot, sampler, SequenceStream(model, request.params), pos=m))
    cache.evict_until(new_cells + reserved)
    return live
