"""When ``kv_layout="auto"`` recreates the engine's context in the other KV layout: the policy, apart from the switch.

What: ``auto`` (:class:`kvrt.runtime.admission.EngineConfig`) runs split and turns unified when the request at the
head of the queue needs more than a slot's share: it waits until nothing runs; pinned prefixes keep the layout, so
such a request is then refused. It turns split again when nothing runs and either the request at the head of the
queue fits a slot and finds less than half of its prompt cached (the pool's cache is not what it needs), or the
engine has been idle for ``split_after_idle_s`` (longer than agents pause between turns) and nothing it caches needs
more than a slot. :class:`LayoutPolicy` answers the engine's worker at two points of a step (placing the head of the
queue, finding nothing to decode) and records the switch it asks for.

Why apart: :class:`kvrt.runtime.batching.Engine` acts (its worker leaves the step loop, closes the context, makes
the other and drops what both tiers cache); this module only decides, from the configuration, the prefix cache and
whether requests wait or run, so the rules are read and changed in one place.

Invariants: a switch is asked for only while nothing runs (a context is recreated empty), and one to split only
while nothing is pinned either; no request is ever held back to make a running context split.
"""

from __future__ import annotations

from kvrt.runtime.admission import EngineConfig, fits_a_slot
from kvrt.runtime.prefix_cache import PrefixCache
from kvrt.runtime.requests import Request, RequestTooLarge


class LayoutPolicy:
    """The worker's ``auto`` layout decisions; :attr:`switch_to` is the one pending, which the engine takes
    (:meth:`take_switch`) when it recreates the context. Only the engine's worker thread uses it."""

    def __init__(self) -> None:
        self.switch_to: bool | None = None  # the layout (shared?) the worker recreates the context in next
        self._idle_since: float | None = None  # when the worker last found nothing to decode (None: busy)

    def admits(self, request: Request, cache: PrefixCache, config: EngineConfig, *, running: bool) -> bool:
        """Whether ``request``, the head of the queue, may be placed in the current layout; False: it waits, and
        :attr:`switch_to` says whether a switch is due first: unified for one that needs more than a slot's share
        once nothing runs, split for one that fits a slot and gains little from the pool's cache (see
        :func:`_split_now`).
        Raises :class:`RequestTooLarge` when pinned prefixes hold the split layout such a request cannot use."""
        if cache.shared and _split_now(request, cache, config, running=running):
            self.switch_to = False
            return False
        if cache.shared or fits_a_slot(request, cache):
            return True
        if cache.pinned:
            raise RequestTooLarge(f"prompt ({len(request.prompt)} tokens) + max_tokens "
                                  f"({request.params.max_tokens}) exceeds a slot's {cache.slot_cells} cells, "
                                  "and pinned prefixes keep the context split; unpin them to run it")
        if not running:
            self.switch_to = True
        return False

    def idle(self, now: float, cache: PrefixCache, config: EngineConfig, *, queued: bool, running: bool) -> None:
        """The worker found nothing to decode at ``now`` (``time.monotonic``): a unified context idle for
        ``split_after_idle_s`` with nothing ``queued`` becomes split again when nothing it caches needs more."""
        self._idle_since = self._idle_since or now
        if (not queued and now - self._idle_since >= config.split_after_idle_s
                and _may_split(cache, config, running=running)
                and all(cache.held(slot) <= config.split_cells for slot in range(cache.n_slots))):
            self.switch_to = False

    def busy(self) -> None:
        """The worker has a step to decode: the idle time starts again from the next idle step."""
        self._idle_since = None

    def take_switch(self) -> bool | None:
        """The switch asked for (the layout, shared?; None: none), cleared: the engine makes it now."""
        shared, self.switch_to = self.switch_to, None
        return shared


def _split_now(request: Request, cache: PrefixCache, config: EngineConfig, *, running: bool) -> bool:
    """Whether a unified context with nothing running should turn split for ``request`` at the head of the queue:
    it fits a slot's stream and the pool's cache holds less than half of its prompt. What the pool caches is dropped
    by the switch (a conversation longer than a slot's stream turns it unified again if it returns); an agent's next
    turn, which finds its history, keeps the pool."""
    too_long = len(request.prompt) + request.params.max_tokens > config.split_cells
    if too_long or not _may_split(cache, config, running=running):
        return False
    kept = max(cache.longest_prefix(request.prompt_array)[1], cache.host_prefix(request.prompt_array)[1])
    return 2 * kept < len(request.prompt)


def _may_split(cache: PrefixCache, config: EngineConfig, *, running: bool) -> bool:
    """Whether ``auto`` may recreate the unified context split now: nothing runs or is pinned."""
    return config.kv_layout == "auto" and cache.shared and config.split_cells > 0 and not running and not cache.pinned
