"""Admission for the batching engine: its limits, what can never fit, and slots for what fits now.

:func:`check_fits` runs on the submitting thread before anything is allocated and
refuses (:class:`RequestTooLarge`) what no state of the engine could hold.
:func:`place` runs on the worker: it finds the longest prefix any slot holds, decides
whether slots and cells are free now (``None``: wait), and if so claims the slots
(a request continues its own cached conversation in place, see :func:`_first_slot`),
shares the prefix with ``seq_cp`` and, in the unified layout, evicts least recently
used cached prefixes until the request's worst case fits beside what running requests
may still write; a slot whose sequence finished less than ``EngineConfig.hold_s`` ago is
held for its conversation's next turn, so a request that would evict it waits (a bounded
number of such turns go first). An ``exact`` request reuses only the whole prefill units of a prefix
that were computed cold (:meth:`kvrt.runtime.prefix_cache.PrefixCache.cold_prefix`): the
rest of its prompt, prefilled from there in steps of its own, then lands in the
micro-batches a cold prefill of the same prompt would use. :func:`share_stops` says where
prefilling requests stop while the queue's head waits to share their prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import SequenceStream
from kvrt.engine.model import Model
from kvrt.engine.sampling import Sampler
from kvrt.errors import KvrtError
from kvrt.prefixes import common_prefix
from kvrt.runtime.host_tier import HostEntry
from kvrt.runtime.live import Choice, Live
from kvrt.runtime.prefix_cache import PrefixCache
from kvrt.runtime.requests import ChoiceEnd, EngineError, Request, RequestEnd, RequestStream, RequestTooLarge

LLAMA_MAX_SEQ = 256
WAIT_FOR_SHARE = 32  # prompt tokens another request is prefilling that are worth waiting a step or two for


KV_LAYOUTS = ("auto", "split", "unified")
WARMUPS = ("auto", "on", "off")
CELL_ALIGN = 256  # llama.cpp rounds a context's cells, and a stream's, up to a multiple of this


@dataclass(frozen=True)
class EngineConfig:
    """The engine's context and scheduling limits.

    ``n_ctx`` cells hold all ``n_seq_max`` slots. ``kv_layout`` says how
    (:mod:`kvrt.runtime.prefix_cache`): ``split`` gives each slot a stream of
    :attr:`split_cells` cells of its own, so a sequence attends over its own history only;
    ``unified`` makes them one pool, so one slot may hold up to ``n_ctx`` and a prefix is
    shared without a copy, but every sequence attends over every used cell; ``auto``
    (the default) runs split and turns unified while requests need more than a slot's share,
    and split again after ``split_after_idle_s`` without work (see
    :class:`kvrt.runtime.batching.Engine`). ``n_batch`` bounds the tokens of one step
    (every decoding choice takes one, so it must be >= ``n_seq_max``); ``prefill_chunk``
    bounds one request's prompt tokens per step; ``max_queue`` the requests waiting for
    admission before :class:`kvrt.runtime.requests.EngineOverloaded`. ``pad_gaps``: in the split layout, a step
    whose sequences leave slots between them gives each idle one a throwaway token, removed after the step, and
    each prefilling one its budget left out a token of its prompt, when that makes the step read fewer bytes a
    token (:func:`kvrt.runtime.step_layout.fill_gaps`).
    ``even_chunks``: in the split layout, a step whose prompt chunks come out of different lengths caps every chunk
    at a shorter one's length, or leaves the last chunk out, when that reads fewer bytes a token
    (:func:`kvrt.runtime.step_layout.even_chunks`).
    ``decode_wait_s``: in the split layout, while prompt chunks fill whole steps, decoding choices sit out the
    steps that come less than this long after one that carried them: each step with decode rows beside prompt
    chunks reads the weights once more for them (:meth:`kvrt.runtime.step_layout.BatchFiller._decodes_now`); 0:
    they join every step.
    ``hold_s``: a slot whose sequence finished less than this long ago is held for that conversation's next turn: a
    request that would evict it waits (:func:`kvrt.runtime.admission.place`); with more agents than slots, an
    agent's next turn then finds its history where its last turn left it. The hold is at least ``hold_s``, and
    longer where next turns are seen to take longer to come back (:mod:`kvrt.runtime.turn_hold`, at most
    ``turn_hold.CAP_S``; ``EngineStats.hold_s`` is the one in force). Whatever ``hold_s``, a queued request that
    continues a history cached in a slot is placed ahead of the queue's head, at most as many of them as the context
    has slots while it is the head (:meth:`kvrt.runtime.batching.Engine._admit`). 0: a waiting request takes any
    cached slot whose next turn is not queued at once.
    ``backend_sampling``: a step's plain greedy rows (no logprobs) are picked inside llama.cpp's decode graph
    (:meth:`kvrt.engine.context.Context.sample_on_device`), so no row of logits is copied out or scanned on the
    host for them. ``host_write_behind`` (with ``host_bytes``): while nothing runs or waits, cached slots are
    copied into the host tier's free room one by one, so an eviction later costs no copy in the admission that
    makes it. ``warmup``: before its first step the worker decodes a micro-batch of throwaway prompt tokens and one
    token in every slot, and empties the cache again (:meth:`kvrt.runtime.batching.Engine`), so llama.cpp's first
    use of its kernels in the process (a GPU build loads each when it is first launched) is paid at the start, not
    in the first requests' steps; ``auto``: where the model's layers are on a GPU.
    """

    n_ctx: int = 4096
    n_seq_max: int = 8
    n_batch: int = 512
    prefill_chunk: int = 256
    max_queue: int = 64
    n_threads: int | None = None
    flash_attn: str = "auto"
    host_bytes: int = 0  # host copies of evicted slots (kvrt.runtime.host_tier); 0: evicted prefixes are recomputed
    kv_layout: str = "auto"
    split_after_idle_s: float = 2.0  # longer than an agent's pause between turns: a switch drops the cache
    pad_gaps: bool = True  # split: slots between a step's sequences get a pad or a prompt token (see above)
    even_chunks: bool = True  # split: a step's prompt chunks evened when that reads fewer bytes a token (see above)
    decode_wait_s: float = 0.5  # split: how long decode rows may sit out steps that prompt chunks fill (see above)
    hold_s: float = 0.1  # how long a finished sequence's slot is held for its conversation's next turn (see above)
    backend_sampling: bool = False  # plain greedy rows picked in the decode's graph (see above)
    host_write_behind: bool = True  # an idle engine copies cached slots to the host tier before they are evicted
    warmup: str = "auto"  # a throwaway decode before the first step: on, off, auto (on where the model is on a GPU)

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
        for name in ("split_after_idle_s", "decode_wait_s", "hold_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise EngineError(f"EngineConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.warmup not in WARMUPS:
            raise EngineError(f"EngineConfig.warmup must be one of {', '.join(WARMUPS)}, got {self.warmup!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise EngineError(f"EngineConfig.kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.kv_layout == "split" and not self.split_cells:
            raise EngineError(f"kv_layout='split' gives each of {self.n_seq_max} slots n_ctx // n_seq_max cells, "
                              f"rounded down to a multiple of {CELL_ALIGN}: n_ctx={self.n_ctx} leaves none; "
                              f"give at least {CELL_ALIGN * self.n_seq_max} cells or use 'unified'")

    @property
    def pool_cells(self) -> int:
        """Cells of the unified layout: all of them, one pool (llama.cpp rounds ``n_ctx`` up)."""
        return -(-self.n_ctx // CELL_ALIGN) * CELL_ALIGN

    @property
    def split_cells(self) -> int:
        """Cells of one slot's stream in the split layout (0: too few cells to split, or one slot)."""
        return self.stream_cells(self.n_seq_max)

    def stream_cells(self, streams: int) -> int:
        """Cells of each of ``streams`` split streams: the pool shared out, rounded down to :data:`CELL_ALIGN`
        (0: fewer than two streams, or too few cells)."""
        if streams < 2:
            return 0
        return self.pool_cells // streams // CELL_ALIGN * CELL_ALIGN

    def wide_streams(self, cells: int) -> int:
        """The most split streams, at most ``n_seq_max``, of which each holds ``cells`` (0: fewer than two do).

        Why: a request longer than a slot's stream could run in one pool (``unified``), where every sequence
        attends over every used cell; when the waiting requests share no prefix, fewer and longer streams keep
        each sequence's attention to its own cells (:mod:`kvrt.runtime.layout_policy` chooses)."""
        need = -(-max(cells, 1) // CELL_ALIGN) * CELL_ALIGN
        streams = min(self.n_seq_max, self.pool_cells // need)
        return streams if streams >= 2 else 0

    @property
    def split_layout(self) -> Layout:
        """The split layout ``auto`` returns to: a stream for each of ``n_seq_max`` slots."""
        return Layout(shared=False, slots=self.n_seq_max)

    @property
    def request_cells(self) -> int:
        """The most cells one request may hold: a slot's stream in a fixed split layout, else the pool (``auto``
        turns unified for a request that needs it)."""
        return self.split_cells if self.kv_layout == "split" else self.pool_cells

    @property
    def n_ubatch(self) -> int:
        """The micro-batch llama.cpp splits a step's batch into."""
        return min(self.n_batch, 512)

    @property
    def prefill_unit(self) -> int:
        """How often the micro-batch boundaries of a cold prefill repeat, counted from position 0.

        A prompt prefilled alone goes in steps of ``min(prefill_chunk, n_batch)`` tokens, each
        split into micro-batches of :attr:`n_ubatch`: the boundaries fall on every multiple of the
        micro-batch when the step is a multiple of it, else on every multiple of the step. A
        prefill resumed at a multiple of this unit, alone in its steps, computes every later
        position in the micro-batch a cold prefill puts it in.
        """
        step = min(self.prefill_chunk, self.n_batch)
        return self.n_ubatch if step % self.n_ubatch == 0 else step

    def starts_shared(self) -> bool:
        """Whether the engine's first context is unified (``auto`` starts split where it can)."""
        return self.kv_layout == "unified" or not self.split_cells

    def first_layout(self) -> Layout:
        """The layout of the engine's first context."""
        return Layout(shared=True, slots=self.n_seq_max) if self.starts_shared() else self.split_layout

    def context_params(self, layout: Layout) -> ContextParams:
        """The context of ``layout``: one pool of ``n_ctx`` cells, or a stream of :meth:`stream_cells` a slot."""
        n_ctx = self.n_ctx if layout.shared else self.stream_cells(layout.slots) * layout.slots
        return ContextParams(n_ctx=n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                             n_seq_max=layout.slots, kv_unified=layout.shared, n_threads=self.n_threads,
                             flash_attn=self.flash_attn, backend_sampling=self.backend_sampling)


class Layout(NamedTuple):
    """A context's KV layout: one pool of cells (``shared``, llama.cpp's unified KV), or a stream of equal cells
    for each of its ``slots`` (llama.cpp's ``kv_unified=false``)."""

    shared: bool
    slots: int


@dataclass
class Pending:
    """A submitted request waiting for admission (a pin has no samplers)."""

    stream: RequestStream
    samplers: list[Sampler]
    pin: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    passed_over: int = 0  # requests placed ahead of it, continuing their histories, while it was the queue's head

    def may_be_passed_over(self, slots: int) -> bool:
        """Whether a request continuing its history may still be placed ahead of it, or a slot held from it: fewer
        than ``slots`` (the context's slot count) have been, so agents that never pause cannot keep it waiting."""
        return self.passed_over < slots

    def end(self, reason: str, error: KvrtError | None = None) -> None:
        """It never ran: its samplers are freed, every choice ends empty with ``reason``, then the request."""
        for sampler in self.samplers:
            sampler.close()
        request = self.stream.request
        for i in range(0 if self.pin else request.n):
            self.stream.push(ChoiceEnd(i, reason, "", ()))
        self.stream.push(RequestEnd(len(request.prompt), 0, 0, error))


def check_in_vocabulary(request: Request, n_vocab: int) -> None:
    """Every prompt token of ``request`` in ``[0, n_vocab)`` (:class:`EngineError` naming the first that is not)."""
    prompt = request.prompt_array
    bad = np.flatnonzero((prompt < 0) | (prompt >= n_vocab))
    if bad.size:
        raise EngineError(f"prompt token {int(prompt[bad[0]])} at position {int(bad[0])} is outside the "
                          f"vocabulary [0, {n_vocab})")


def check_fits(request: Request, config: EngineConfig, n_vocab: int) -> None:
    """Refuse what no state of the engine could run: too many cells, choices or unknown tokens.

    A slot holds at most the pool's cells (unified, or ``auto``, which turns unified for
    it), or its stream's in a fixed split layout.
    """
    n, limit, prompt = request.n, request.params.max_tokens, len(request.prompt)
    split = config.kv_layout == "split"
    n_cells = config.request_cells
    where = (f"a slot's {n_cells} cells (kv_layout 'split': {config.n_ctx} cells over {config.n_seq_max} slots)"
             if split else f"the context's {n_cells} cells")
    if prompt + limit > n_cells:
        raise RequestTooLarge(f"prompt ({prompt} tokens) + max_tokens ({limit}) = {prompt + limit} exceeds {where}")
    if not split and request.cells > n_cells:
        raise RequestTooLarge(f"prompt ({prompt} tokens) + n ({n}) x max_tokens ({limit}) = {request.cells} "
                              f"cells exceed the context's {n_cells}")
    if n > config.n_seq_max:
        raise RequestTooLarge(f"n={n} choices need {n} sequence slots; the engine has {config.n_seq_max}")
    check_in_vocabulary(request, n_vocab)


def fits_a_slot(request: Request, cache: PrefixCache) -> bool:
    """Whether ``request`` fits the cache's layout now: each of its slots within a slot's cells, and, shared,
    all of them within the pool."""
    prompt, limit = len(request.prompt), request.params.max_tokens
    return prompt + limit <= cache.slot_cells and (not cache.shared or request.cells <= cache.n_cells)


def place(cache: PrefixCache, model: Model, pending: Pending, reserved: int, prefilling: Sequence[np.ndarray] = (),
          *, hold_s: float = 0.0, now: float | None = None) -> Live | None:
    """Slots and the cached prefix for ``pending``; ``None`` while they are not free yet.

    ``reserved`` is the cells running requests may still write. ``prefilling`` is the prompts
    of running requests still being prefilled: when one shares at least :data:`WAIT_FOR_SHARE`
    tokens more of ``pending``'s prompt than is cached now, ``pending`` waits for it (a step
    or two) and then shares those cells instead of prefilling them again, so many agents
    starting with one preamble prefill it once. Raises
    :class:`RequestTooLarge` when pinned prefixes leave too few slots or cells for good.

    An ``exact`` request's shared prefix ends on a multiple of the cache's unit, within what
    its source computed cold: a prefix that ends mid-unit is recomputed from the unit's start.

    ``hold_s``: a request that would evict a cached slot whose sequence finished less than
    ``hold_s`` before ``now`` (default: the monotonic clock's now) waits, unless as many
    requests as the cache has slots were placed ahead of it while it waited
    (``Pending.passed_over``, :func:`_evicts_a_held_slot`).
    """
    request = pending.stream.request
    prompt = request.prompt
    src, m, entry, h = _reusable(cache, pending)
    if _shares_what_is_coming(request.prompt_array, max(m, h), prefilling):
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
    if cache.shared:  # one pool: the request's cells must fit beside pinned and running ones
        own = new_cells + (0 if src in cache.pinned else m)  # a pinned source's cells are the pin's
        beside_pins = cache.n_cells - cache.pinned_cells()
        if own > beside_pins:
            raise RequestTooLarge(f"the request needs {own} cells; {beside_pins} of the context's "
                                  f"{cache.n_cells} are not held by pinned prefixes")
        free_now = cache.n_cells - cache.used_cells  # no more than eviction would free; O(1), where that is O(cells)
        if free_now - reserved < new_cells and (cache.cells_if_evicted(keep=(src, m) if src is not None else None)
                                                - reserved < new_cells):
            return None
    if cache.available_slots() < slots_needed:
        return None
    now = time.monotonic() if now is None else now
    if hold_s and pending.may_be_passed_over(cache.n_slots) and _evicts_a_held_slot(
            cache, src, m, request.agent, slots_needed, since=now - hold_s):
        return None
    # a conversation's next turn extends all of the history it finds; when that history ended, read before a take-over
    ended = cache.released_at(src) if src is not None and m == cache.held(src) else None
    first, continued = _first_slot(cache, src, m, request.agent)
    restored = 0
    if src is not None and not continued:
        cache.copy_prefix(src, first, 0, m)
    elif entry is not None:
        cache.evict_until(new_cells + reserved)  # the restore writes new cells: make them free first
        if cache.restore(first, entry, h):
            m = restored = h
    live = Live(request, pending.stream, first, reused=m, restored=restored, pin=pending.pin, prefilled=m)
    if not continued:  # a next turn whose history left its slot: the host copy it extends says when it ended
        ended = entry.released_at if entry is not None and restored == len(entry.tokens) else None
    if not pending.pin and ended is not None and pending.queued_at >= ended:
        live.turnaround = pending.queued_at - ended
    for i, sampler in enumerate(pending.samplers):
        slot = first if i == 0 else cache.claim()
        assert slot is not None  # available_slots() counted them
        if i > 0:
            cache.follow(first, slot, 0, m, complete=False)
        live.choices.append(Choice(i, slot, sampler, SequenceStream(model, request.params), pos=m))
    cache.evict_until(new_cells + reserved)
    return live


def share_stops(cache: PrefixCache, pending: Pending, running: Sequence[Live], chunk: int) -> dict[int, int]:
    """Where prefilling requests of ``running`` stop this step (slot -> prompt position) for ``pending``, the
    queue's head, left waiting: when it waits to share the prefix one of them is prefilling (:func:`place`'s rule)
    and that one's prompt goes on for at most ``chunk`` tokens past it, that one stops at the shared prefix's end.

    Why: the head is then admitted next step with exactly that prefix, and the stopped request's rest of its prompt
    is prefilled in that step beside the head's own rest (fanout: a document, then each agent's question). Without
    the stop it finishes its prompt a step earlier and its one-token decode row lands among the others' prompt
    chunks, where llama.cpp's split layout takes one token from each sequence of the run into a micro-batch of its
    own, and the first micro-batches hold a few of the rows with logits each (the 8-agent CPU fanout, the step that
    ends the document and the next: 1.93 s, stopped 1.81 s, medians of 6).

    Invariant: every stop lies strictly inside its request's unprefilled prompt (``prefilled < stop < len``), so a
    stopped request still gets tokens this step. None in the unified layout (one micro-batch split takes any mix
    of rows) or for ``exact`` requests (their chunks keep a cold prefill's layout).
    """
    request = pending.stream.request
    if cache.shared or request.exact:
        return {}
    _, m, _, h = _reusable(cache, pending)
    stops = {}
    for live in running:
        if not live.prefilling or live.request.exact:
            continue
        end = min(common_prefix(live.request.prompt_array, request.prompt_array), len(request.prompt) - 1)
        rest = len(live.prompt) - end
        if live.prefilled < end and 0 < rest <= chunk and _waits_to_share(len(request.prompt), max(m, h), end):
            stops[live.slot] = end
    return stops


def _reusable(cache: PrefixCache, pending: Pending) -> tuple[int | None, int, HostEntry | None, int]:
    """The slot holding the longest prefix of ``pending``'s prompt and its length, and the host copy holding the
    longest and its length, each cut to what the request may reuse: all but the last prompt token (a choice samples
    its logits; a pin may take all), in whole units of the cache for an ``exact`` request."""
    request = pending.stream.request
    unit = cache.unit if request.exact else 1
    limit = len(request.prompt) - (0 if pending.pin else 1)
    src, m = cache.longest_prefix(request.prompt_array, cold=request.exact)
    entry, h = cache.host_prefix(request.prompt_array, cold=request.exact)
    return src, min(m, limit) // unit * unit, entry, min(h, limit) // unit * unit


def _waits_to_share(prompt: int, cached: int, coming: int) -> bool:
    """:func:`place`'s share rule: a request of ``prompt`` tokens, ``cached`` of them reusable now, waits while a
    prompt being prefilled shares ``coming`` tokens with it, at least :data:`WAIT_FOR_SHARE` more."""
    return min(coming, prompt - 1) >= cached + WAIT_FOR_SHARE


def _shares_what_is_coming(prompt: np.ndarray, cached: int, prefilling: Sequence[np.ndarray]) -> bool:
    """:func:`_waits_to_share` for the longest prefix ``prompt`` shares with one of ``prefilling``, found without
    measuring it: only whether one shares the first ``cached + WAIT_FOR_SHARE`` tokens matters, and their last is
    compared first, so a prompt that differs there costs no pass over the rest.

    Why: measuring that prefix is a full comparison of every pair of waiting and prefilling prompts, quadratic in
    the agents admitted in one step, each as long as their shared document."""
    k = cached + WAIT_FOR_SHARE
    if not _waits_to_share(len(prompt), cached, k):  # not even a share of k tokens is worth waiting for
        return False
    head = prompt[:k]
    return any(len(other) >= k and other[k - 1] == head[k - 1] and common_prefix(other[:k], head) == k
               for other in prefilling)


def _continues(cache: PrefixCache, src: int | None, m: int, agent: str | None) -> bool:
    """Whether a request of ``agent`` sharing ``m`` positions with slot ``src`` runs on in that slot (see
    :func:`_first_slot`).

    A cached, unpinned source is continued when the request extends all of it (a
    conversation's next turn), or when no slot is free and either the request keeps at
    least half of it (its own history with a changed ending, llama-server's
    slot-similarity rule: claiming another slot would evict some other conversation for
    nothing) or the source is the slot a claim would evict, unless the source is another
    agent's history (``agent``: the request's): then only extending all of it continues it.
    """
    if src is None or not cache.reusable(src):
        return False
    held = cache.held(src)
    foreign = cache.owner(src) not in (None, agent)  # cutting it would lose that agent's history
    return m == held or (not foreign and not cache.free_slots() and (2 * m >= held or cache.next_victim() == src))


def _evicts_a_held_slot(cache: PrefixCache, src: int | None, m: int, agent: str | None, slots: int, *,
                        since: float) -> bool:
    """Whether a request of ``agent`` that needs ``slots`` slots, sharing ``m`` positions with slot ``src``, would
    evict a cached slot whose sequence finished after ``since``, or cut one short by continuing it in place.

    Why: with more agents than slots, a fresh request waiting as an agent's turn ends takes that agent's slot
    before its next turn arrives (a few milliseconds later), and that turn then prefills its whole history again,
    or restores it from the host tier, which holds as few of them as the slots do (a CPU replay of issue 24's 64
    private agents in 37 streams: 108k of 374k tokens prefilled again). Held briefly, the next turn finds its
    history in place (:meth:`kvrt.runtime.batching.Engine` places such turns ahead of the waiting request).
    """
    lost: list[int | None] = []
    if src is not None and _continues(cache, src, m, agent):
        slots -= 1
        lost += [src] if m < cache.held(src) else []
    if slots > cache.free_slots():
        lost.append(cache.next_victim(avoid=src))
    return any(slot is not None and cache.released_at(slot) > since for slot in lost)


def _first_slot(cache: PrefixCache, src: int | None, m: int, agent: str | None) -> tuple[int, bool]:
    """The slot a request's first choice runs in, and whether it continues ``src`` (sharing ``m`` positions) in place
    (:func:`_continues`). Otherwise a free slot, or the cached one a claim evicts (other than the source), gets a
    copy of the prefix, and the source stays as it was for whoever shares it.
    """
    if src is not None and _continues(cache, src, m, agent):
        cache.take_over(src, m)
        return src, True
    first = cache.claim(avoid=src)
    if first is None:  # only the source itself is left to take
        assert src is not None
        cache.take_over(src, m)
        return src, True
    return first, False
