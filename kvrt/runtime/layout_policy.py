"""When ``kv_layout="auto"`` recreates the engine's context in another KV layout: the policy, apart from the switch.

What: ``auto`` (:class:`kvrt.runtime.admission.EngineConfig`) runs split, a stream for each of ``n_seq_max`` slots.
When the request at the head of the queue needs more than a slot's stream, it waits until nothing runs and the
context is recreated roomier: split into fewer, longer streams when the waiting requests share no prefix with it
and those streams run at least half as many of them as one pool would (each sequence keeps attending over its
own cells only; the rest queue), else one pool (unified: a shared prefix is computed once and held once, but
every sequence attends over every used cell). The choice is made for the requests that arrive with it: once
``n_seq_max - 1`` wait behind it, one that waits shares half of its prompt (that settles it: one pool), or it has
waited :data:`SETTLE_S`. A roomier context chooses again, with nothing running, for such a request that finds
less than half of its prompt cached (a burst of private histories after a shared document, or the reverse).
Pinned prefixes keep the layout, so such a request is then refused. It turns back to the ``n_seq_max`` streams
when nothing runs and either the request at the head of the queue fits one and finds less than half of its prompt
cached (what the roomier layout caches is not what it needs), or the engine has been idle for
``split_after_idle_s`` (longer than agents pause between turns) and nothing it caches needs more than a slot.
:class:`LayoutPolicy` answers the engine's worker at two points of a step (placing the head of the queue, finding
nothing to decode) and records the switch it asks for.

Why apart: :class:`kvrt.runtime.batching.Engine` acts (its worker leaves the step loop, closes the context, makes
the other and drops what both tiers cache); this module only decides, from the configuration, the prefix cache and
the requests that wait or run, so the rules are read and changed in one place.

Invariants: a switch is asked for only while nothing runs (a context is recreated empty), and one back to the
``n_seq_max`` streams only while nothing is pinned either; no request is ever held back to make a running context
split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvrt.prefixes import common_prefix
from kvrt.runtime.admission import EngineConfig, Layout, fits_a_slot
from kvrt.runtime.prefix_cache import PrefixCache
from kvrt.runtime.requests import Request, RequestTooLarge

SETTLE_S = 0.1  # how long the first request needing a roomier layout waits for others arriving with it


class LayoutPolicy:
    """The worker's ``auto`` layout decisions; :attr:`switch_to` is the one pending, which the engine takes
    (:meth:`take_switch`) when it recreates the context. Only the engine's worker thread uses it."""

    def __init__(self) -> None:
        self.switch_to: Layout | None = None  # the layout the worker recreates the context in next
        self._idle_since: float | None = None  # when the worker last found nothing to decode (None: busy)
        self._split_failed = False  # the n_seq_max streams could not be made again: no further tries
        self.recheck_in: float | None = None  # seconds until the head waiting for a roomier layout is due a choice

    def admits(self, request: Request, cache: PrefixCache, config: EngineConfig, *, running: bool,
               waiting: Callable[[], Sequence[Request]] = tuple, waited_s: float = math.inf) -> bool:
        """Whether ``request``, the head of the queue (queued ``waited_s`` ago), may be placed in the current
        layout; False: it waits, and :attr:`switch_to` says whether a switch is due first: a roomier layout
        (:func:`_roomier`, for the requests ``waiting()`` behind it too, asked for only then) for one that needs
        more than a slot's stream once nothing runs, the ``n_seq_max`` streams for one that fits them and gains
        little from what is cached (see :func:`_split_now`). The roomier layout is chosen once ``n_seq_max - 1``
        requests wait behind the head, one of them shares half of its prompt (one pool, whatever else arrives), or
        it has waited :data:`SETTLE_S`: agents that start together arrive over some tens of milliseconds, and the
        first alone says nothing of whether they share a prefix; :attr:`recheck_in` then says when to ask again.
        Raises :class:`RequestTooLarge` when pinned prefixes hold the split layout such a request cannot use."""
        self.recheck_in = None
        if not self._split_failed and _split_now(request, cache, config, running=running):
            self.switch_to = config.split_layout
            return False
        fits = cache.shared or (fits_a_slot(request, cache) and request.n <= cache.n_slots)
        if fits and (self._split_failed or not _rechoose(request, cache, config, running=running)):
            return True
        if cache.pinned:
            raise RequestTooLarge(f"prompt ({len(request.prompt)} tokens) + max_tokens "
                                  f"({request.params.max_tokens}) exceeds a slot's {cache.slot_cells} cells, "
                                  "and pinned prefixes keep the context split; unpin them to run it")
        if running:
            return False
        behind = waiting()
        settled = len(behind) >= config.n_seq_max - 1 or waited_s >= SETTLE_S
        if not settled and not _shares_prefix(request, behind[:config.n_seq_max - 1]):
            self.recheck_in = SETTLE_S - waited_s
            return False
        layout = _roomier(request, behind, config)
        if fits and layout == Layout(cache.shared, cache.n_slots):
            return True
        self.switch_to = layout
        return False

    def idle(self, now: float, cache: PrefixCache, config: EngineConfig, *, queued: bool, running: bool) -> None:
        """The worker found nothing to decode at ``now`` (``time.monotonic``): a roomier context idle for
        ``split_after_idle_s`` with nothing ``queued`` returns to the ``n_seq_max`` streams when nothing it caches
        needs more."""
        self._idle_since = self._idle_since or now
        if not queued:
            self.recheck_in = None  # no head is waiting for a choice
        if (not queued and now - self._idle_since >= config.split_after_idle_s and not self._split_failed
                and _may_split(cache, config, running=running)
                and all(cache.held(slot) <= config.split_cells for slot in range(cache.n_slots))):
            self.switch_to = config.split_layout

    def busy(self) -> None:
        """The worker has a step to decode: the idle time starts again from the next idle step."""
        self._idle_since = None

    def take_switch(self) -> Layout | None:
        """The switch asked for (None: none), cleared: the engine makes it now."""
        layout, self.switch_to = self.switch_to, None
        return layout

    def split_failed(self) -> None:
        """The engine could not make the ``n_seq_max`` streams again, or another layout than its pool: it keeps
        the layout it has for good."""
        self._split_failed = True


def _roomier(request: Request, waiting: Sequence[Request], config: EngineConfig) -> Layout:
    """The layout for ``request``, longer than a slot's stream, and the requests ``waiting`` behind it (the next
    ``n_seq_max - 1`` are looked at): fewer, longer split streams that hold the longest of them, when none of
    them shares half of ``request``'s prompt and those streams run at least half as many of them at once as one
    pool's cells hold; else one pool."""
    group = [request, *waiting[:config.n_seq_max - 1]]
    streams = config.wide_streams(max(len(r.prompt) + r.params.max_tokens for r in group))
    pool = Layout(shared=True, slots=config.n_seq_max)
    if streams < max(2, request.n) or _shares_prefix(request, group[1:]):
        return pool
    in_pool, cells = 0, 0
    for r in group:
        cells += r.cells
        if cells > config.pool_cells:
            break
        in_pool += 1
    return Layout(shared=False, slots=streams) if 2 * streams >= in_pool else pool


def _shares_prefix(request: Request, others: Sequence[Request]) -> bool:
    """Whether one of ``others`` starts with at least half of ``request``'s prompt: a prefix one pool would
    compute and hold once for both."""
    half = max(1, len(request.prompt) // 2)
    prompt = request.prompt_array
    return any(common_prefix(prompt, other.prompt_array) >= half for other in others)


def _split_now(request: Request, cache: PrefixCache, config: EngineConfig, *, running: bool) -> bool:
    """Whether a roomier context with nothing running should return to the ``n_seq_max`` streams for ``request``
    at the head of the queue: it fits one and what is cached holds less than half of its prompt. What the roomier
    context caches is dropped by the switch (a conversation longer than a slot's stream makes it roomier again if
    it returns); an agent's next turn, which finds its history, keeps it."""
    too_long = len(request.prompt) + request.params.max_tokens > config.split_cells
    return not too_long and _may_split(cache, config, running=running) and _little_cached(request, cache)


def _rechoose(request: Request, cache: PrefixCache, config: EngineConfig, *, running: bool) -> bool:
    """Whether a roomier context with nothing running should choose its layout again for ``request`` at the head
    of the queue, which needs more than one of the ``n_seq_max`` streams (:func:`_split_now` covers the others)
    and finds less than half of its prompt cached: it was chosen for other requests (one pool for a shared
    document, fewer streams for private histories), and the next burst may want the other."""
    return _may_split(cache, config, running=running) and _little_cached(request, cache)


def _little_cached(request: Request, cache: PrefixCache) -> bool:
    """Whether less than half of ``request``'s prompt is cached, in the context or the host tier: what a layout
    switch would drop is worth little to it."""
    kept = max(cache.longest_prefix(request.prompt_array)[1], cache.host_prefix(request.prompt_array)[1])
    return 2 * kept < len(request.prompt)


def _may_split(cache: PrefixCache, config: EngineConfig, *, running: bool) -> bool:
    """Whether ``auto`` may recreate a roomier context (one pool, or fewer streams than ``n_seq_max``) with its
    ``n_seq_max`` streams now: nothing runs or is pinned."""
    roomier = cache.shared or cache.n_slots < config.n_seq_max
    return (config.kv_layout == "auto" and roomier and config.split_cells > 0 and not running
            and not cache.pinned)
