"""Continuous batching: many requests share one llama.cpp context and one ``llama_decode`` per step.

An :class:`Engine` owns one context with ``n_seq_max`` sequence slots, and a worker
thread that repeats :meth:`Engine.step`:

1. hooks and housekeeping: ``before_step()`` (e.g. growing the context), commands
   from other threads (unpin), cancelled and expired requests end;
2. admission: waiting requests, round robin by agent (:mod:`kvrt.runtime.fair_queue`; first
   come first served among one agent's or anonymous ones), get slots; the longest
   token prefix any slot already holds is shared with ``seq_cp`` (the prefix cache of
   :mod:`kvrt.runtime.prefix_cache`), so only the rest of the prompt is prefilled; a request
   waiting to share what another is prefilling stops that one's prompt at the shared end; a slot
   whose request just finished is held for that conversation's next turn (``EngineConfig.hold_s``,
   or as long as next turns are seen to take: :mod:`kvrt.runtime.turn_hold`), and a queued next
   turn of a history cached in a slot is placed ahead of the requests that would evict it;
3. one :class:`kvrt.engine.batch.Batch` laid out by :mod:`kvrt.runtime.step_layout`: the last
   sampled token of every decoding choice, then prompt chunks of at most ``prefill_chunk``
   tokens per request, round robin, up to ``n_batch`` tokens: a long prompt never stalls the
   others for more than a chunk (while an ``exact`` request prefills, one chunk of it alone);
4. one ``ctx.decode``; then the mirror of the cells is updated, the forks of ``n > 1``
   requests share the chunk's cells, ``after_chunk(p0, p1)`` hooks run, and every row
   with logits is sampled by its choice's own sampler and streamed out.

A request that can never fit (prompt + max_tokens beyond the cells, more choices than
slots) is refused with :class:`kvrt.runtime.requests.RequestTooLarge` before anything is
allocated; one that fits later waits. Nothing a refusal does touches running requests.
All llama.cpp calls happen on the worker thread.

The KV layout (``EngineConfig.kv_layout``, :mod:`kvrt.runtime.prefix_cache`): ``split``
gives every slot a stream of its own, so attention costs what a sequence's own history
holds; ``unified`` pools the cells, so one request may hold more than a slot's share
and prefixes are shared without copies. Under ``auto`` the worker recreates the context
in another layout (one pool, or split into fewer, longer streams) when
:mod:`kvrt.runtime.layout_policy` asks it to (only while nothing runs). Nothing cached
crosses a switch: llama.cpp's sequence state records the stream count of the context it
came from and is refused by another, so the slots and the host tier's copies are dropped,
and a returning conversation is prefilled again.

The step's parts live apart: how its batch is packed in :mod:`kvrt.runtime.step_layout`,
when the KV layout switches in :mod:`kvrt.runtime.layout_policy`, admission's limits and
slot placement in :mod:`kvrt.runtime.admission`, its phase times in
:mod:`kvrt.runtime.step_trace`; the engine runs the loop, decodes, samples and hands out.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import numpy as np

from kvrt.bindings import lib
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.decode_step import greedy_picks
from kvrt.engine.generation import GenerationParams
from kvrt.engine.micro_batches import count_micro_batches
from kvrt.engine.model import Model
from kvrt.engine.sampling import SEEDS, Sampler
from kvrt.errors import DecodeError, KvrtError
from kvrt.runtime.admission import (
    EngineConfig,
    Layout,
    Pending,
    check_fits,
    check_in_vocabulary,
    fits_a_slot,
    place,
    share_stops,
)
from kvrt.runtime.fair_queue import FairQueue
from kvrt.runtime.host_tier import HostMemory, HostTier
from kvrt.runtime.layout_policy import LayoutPolicy
from kvrt.runtime.live import Choice, Live
from kvrt.runtime.prefix_cache import PrefixCache
from kvrt.runtime.requests import (
    AgentBusy,
    EngineClosed,
    EngineError,
    EngineOverloaded,
    EngineStats,
    Request,
    RequestStream,
    RequestTooLarge,
)
from kvrt.runtime.step_layout import BatchFiller, Row, StepBatch, sample_where
from kvrt.runtime.step_trace import StepClock, StepRecord, StepTimer, StepTimes, StepTrace
from kvrt.runtime.turn_hold import TurnHold
from kvrt.state.hostpool import host_memory

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # an idle worker re-checks deadlines this often (never part of any assertion)


class Engine:
    """Continuous batching over one model (see the module docstring); use as a context manager.

    ``host_memory`` provides the host tier's memory, ``config.host_bytes`` of it, once at the start: by default
    :func:`kvrt.state.hostpool.host_memory` (pinned when CuPy sees a GPU, so restores copy at the PCIe limit).
    """

    def __init__(self, model: Model, config: EngineConfig | None = None, *,
                 before_step: Callable[[], None] | None = None, host_memory: HostMemory = host_memory,
                 trace: StepTrace | None = None, **overrides: Any) -> None:
        self.config = replace(config or EngineConfig(), **overrides)
        self.model = model
        self.before_step = before_step
        self.trace = trace
        self.ctx = Context(model, self.config.context_params(self.config.first_layout()))
        try:
            tier = HostTier(self.config.host_bytes, memory=host_memory) if self.config.host_bytes else None
            self.cache = PrefixCache(self.ctx, tier, unit=self.config.prefill_unit)
            self.batch = Batch(self.ctx.n_batch)
        except BaseException:
            self.ctx.close()
            raise
        self._lock = threading.Lock()
        self._queue = FairQueue()
        self._commands: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._live: list[Live] = []
        self._pins: dict[str, int] = {}
        self._stops: dict[int, int] = {}  # slot -> where its prompt stops this step (admission.share_stops)
        self._hold = TurnHold(self.config.hold_s, self.config.n_seq_max)  # EngineConfig.hold_s, or as measured
        self._hold_ends_in: float | None = None  # seconds until the next slot's hold ends
        self._ids = itertools.count(1)
        self._wake = threading.Event()
        self._closing = False
        self._steps = self._prefilled = self._reused = self._restored = self._decoded = self._relayouts = 0
        self._relayout_s = 0.0  # seconds spent recreating the context (EngineStats.relayout_s)
        self._placed_wait_s = 0.0  # the longest queue wait of the requests placed since the last step decoded
        self._micro_batches = self._sampled_on_device = self._sampler_switches = 0
        self._filler = BatchFiller(self.batch, model, chunk=self.config.prefill_chunk, pad_gaps=self.config.pad_gaps,
                                   even_chunks=self.config.even_chunks, decode_wait_s=self.config.decode_wait_s)
        self._layout_policy = LayoutPolicy()
        self._clock = StepClock()
        self._thread = threading.Thread(target=self._run, name=f"kvrt-engine-{model.path.stem}", daemon=True)
        self._thread.start()

    # -- other threads' side ----------------------------------------------------------
    @property
    def n_cells(self) -> int:
        """The most cells one request may hold (prompt and output), from the configuration: other threads read it
        while the worker may be recreating the context in another layout."""
        return self.config.request_cells

    def submit(self, request: Request, *, notify: Callable[[], None] | None = None) -> RequestStream:
        """Queue ``request``; its events arrive on the returned stream (see :class:`RequestStream`).

        Raises :class:`RequestTooLarge` for what can never fit, :class:`EngineOverloaded`
        when ``max_queue`` requests already wait, and the sampler's error for a bad grammar.
        """
        check_fits(request, self.config, self.model.n_vocab)
        samplers: list[Sampler] = []
        try:
            for i in range(request.n):
                sampling = request.params.sampling
                samplers.append(Sampler(replace(sampling, seed=(sampling.seed + i) % SEEDS), model=self.model))
            return self._enqueue(Pending(self._stream("req", request, notify), samplers))
        except BaseException:
            for sampler in samplers:
                sampler.close()
            raise

    def pin(self, tokens: Sequence[int], *, notify: Callable[[], None] | None = None,
            exact: bool = False) -> RequestStream:
        """Prefill ``tokens`` (sharing any cached prefix) and keep their cells until :meth:`unpin`.

        The stream's id is the pin's id; its :class:`RequestEnd` says the prefix is in. ``exact``: prefilled
        as an exact request is (see :class:`Request`), so exact requests can reuse all of it that a cold
        prefill would compute the same way.
        """
        request = Request(tokens, GenerationParams(max_tokens=1), exact=exact)
        limit = self.cache.slot_cells  # a pin keeps the layout it was made in
        if len(request.prompt) > limit:
            raise RequestTooLarge(f"a pin of {len(request.prompt)} tokens exceeds a slot's {limit} cells")
        check_in_vocabulary(request, self.model.n_vocab)
        return self._enqueue(Pending(self._stream("pin", request, notify), [], pin=True))

    def preload(self, tokens: Sequence[int], state: np.ndarray, *, owner: str | None = None,
                check: Callable[[Context], None] | None = None) -> Future[bool]:
        """Put ``state`` (llama.cpp's sequence state, ``llama_state_seq_get_data`` bytes, of a sequence holding
        exactly ``tokens``) into the host tier as ``owner``'s history, as if a slot holding it had been evicted:
        the next request whose prompt starts with ``tokens`` restores it instead of prefilling them. On the worker:
        ``check(ctx)`` first, raising (into the future) when the context cannot take the state. The future says
        whether the tier kept it (False without a host tier, or larger than it); ``state`` is copied before it
        resolves."""
        tokens = tuple(int(t) for t in tokens)

        def put() -> bool:
            if check is not None:
                check(self.ctx)
            return self.cache.host is not None and self.cache.host.keep_bytes(tokens, state, owner=owner)

        return self._call(put)

    def cached_prefix(self, tokens: Sequence[int]) -> Future[int]:
        """How many of ``tokens``' first positions this engine holds cached (in a slot of its context or a copy in
        its host tier; the longer of the two), read on the worker: what prefix-affinity routing compares across
        devices."""
        probe = tuple(int(t) for t in tokens)

        def longest() -> int:
            return max(self.cache.longest_prefix(probe)[1], self.cache.host_prefix(probe)[1])

        return self._call(longest)

    def hand_over(self, agent: str) -> Future[tuple[tuple[int, ...], np.ndarray] | None]:
        """Take ``agent``'s history out of this engine, to move it to another (another device's copy of the model:
        :meth:`preload` it there): the tokens and llama.cpp sequence state of what this engine keeps of it (a
        cached slot, else a host copy), removed from here; ``None`` when it keeps nothing. Refused
        (:class:`AgentBusy`) while a request of the agent is queued or running here: its history is still
        growing."""

        def take() -> tuple[tuple[int, ...], np.ndarray] | None:
            with self._lock:
                queued = any(p.stream.request.agent == agent for p in self._queue)
            if queued or any(live.request.agent == agent for live in self._live):
                raise AgentBusy(f"agent {agent!r} has a request queued or running here; move it between turns")
            return self.cache.hand_over(agent)

        return self._call(take)

    def unpin(self, pin_id: str) -> Future[bool]:
        """Let a pinned prefix be evicted again; the future says whether ``pin_id`` was pinned."""
        return self._call(lambda: self._unpin(pin_id))

    def stats(self) -> EngineStats:
        with self._lock:
            queued = len(self._queue)
        cache = self.cache
        clock = self._clock
        host = cache.host.stats if cache.host is not None else None
        return EngineStats(
            steps=self._steps, prefilled_tokens=self._prefilled, reused_tokens=self._reused,
            restored_tokens=self._restored, decoded_tokens=self._decoded,
            host_kept=host.kept if host else 0, host_keep_s=host.keep_s if host else 0.0, busy_s=clock.busy_s,
            decode_s=clock.decode_s, admit_s=clock.admit_s, fill_s=clock.fill_s, sample_s=clock.sample_s,
            host_cpu_s=clock.host_cpu_s, queued=queued, active=len(self._live), used_cells=cache.used_cells,
            n_cells=cache.n_cells, slots=tuple(cache.describe()), kv_layout="unified" if cache.shared else "split",
            slot_cells=cache.slot_cells, relayouts=self._relayouts, relayout_s=self._relayout_s,
            micro_batches=self._micro_batches, host_dropped=host.dropped if host else 0,
            sampled_on_device=self._sampled_on_device,
            sampler_switches=self._sampler_switches, hold_s=self._hold.seconds)

    def close(self) -> None:
        """Stop the worker; waiting and running requests end with :class:`EngineClosed`."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake.set()
        self._thread.join()
        self._fail_all(EngineClosed("the engine was closed"))
        self.batch.close()
        self.ctx.close()
        if self.cache.host is not None:
            self.cache.host.close()
        if self.trace is not None:
            self.trace.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stream(self, kind: str, request: Request, notify: Callable[[], None] | None) -> RequestStream:
        return RequestStream(f"{kind}-{next(self._ids)}", request, notify=notify, on_cancel=self._wake.set)

    def _enqueue(self, pending: Pending) -> RequestStream:
        with self._lock:
            if self._closing:
                raise EngineClosed("the engine is closed")
            if len(self._queue) >= self.config.max_queue:
                raise EngineOverloaded(f"{len(self._queue)} requests are waiting (max_queue="
                                       f"{self.config.max_queue}); retry later")
            self._queue.append(pending)
        self._wake.set()
        return pending.stream

    def _call(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closing:
                raise EngineClosed("the engine is closed")
            self._commands.append((fn, future))
        self._wake.set()
        return future

    # -- the worker ---------------------------------------------------------------------
    def _run(self) -> None:
        if self._warms_up():
            self._warm_up()
        while not self._closing:
            with self.ctx._handle.use():  # the context is this thread's: nobody frees it under a decode
                self._loop()
            layout = self._layout_policy.take_switch()
            if layout is not None:  # outside use(): the switch closes this context
                self._switch(layout)

    def _warms_up(self) -> bool:
        """Whether the worker warms llama.cpp up before its first step (``EngineConfig.warmup``)."""
        on_gpu = self.model.params.n_gpu_layers != 0 and bool(lib().llama_supports_gpu_offload())
        return self.config.warmup == "on" or (self.config.warmup == "auto" and on_gpu)

    def _warm_up(self) -> None:
        """One micro-batch of throwaway prompt tokens in the first slot, then one token in every slot, decoded and
        dropped before the first step (see ``EngineConfig.warmup``). Invariant: the cache is empty after it, as
        the prefix cache's mirror has it, and no counter of :meth:`stats` moves; a failed warm-up is logged and
        the engine serves as it would have without one."""
        n = min(self.ctx.params.n_ubatch, self.cache.slot_cells - 1)
        try:
            with self.ctx._handle.use():
                try:
                    self.batch.clear()
                    self.batch.add_sequence([i % self.model.n_vocab for i in range(n)], 0, 0, logits_last=True)
                    self.ctx.decode(self.batch)
                    self.batch.clear()
                    for slot in range(self.cache.n_slots):
                        self.batch.add_sequence((0,), n if slot == 0 else 0, slot, logits_last=True)
                    self.ctx.decode(self.batch)
                    self.ctx.synchronize()
                finally:
                    self.batch.clear()
                    self.ctx.clear()
        except KvrtError:
            log.warning("the warm-up decode failed; serving without it", exc_info=True)

    def _loop(self) -> None:
        while not self._closing and self._layout_policy.switch_to is None:
            try:
                busy = self.step()
            except Exception as exc:  # a bug: fail what runs, keep serving the next requests
                log.exception("engine step failed")
                self._fail_all(EngineError(f"the engine's step failed: {exc!r}"), queued=False)
                busy = False
            if not busy and self._layout_policy.switch_to is None:  # a switch is made at once, not after a wait
                self._wake.wait(min(_IDLE_WAIT_S, self._layout_policy.recheck_in or _IDLE_WAIT_S,
                                    self._hold_ends_in or _IDLE_WAIT_S))
                self._wake.clear()

    def step(self) -> bool:
        """One turn of the loop (on the worker thread); False when it did nothing: nothing to decode, no cached
        slot to copy to the host tier (:meth:`_write_behind`)."""
        timer = StepTimer()
        if self.before_step is not None:
            self.before_step()
        self._run_commands()
        self._reap(time.monotonic())
        self._admit()
        timer.filling()
        step = self._lay_out()
        if not step.rows:
            self._layout_policy.idle(time.monotonic(), self.cache, self.config, queued=bool(self._queue),
                                     running=bool(self._live))
            return self._write_behind()
        self._layout_policy.busy()
        if self.config.backend_sampling:
            self._sampler_switches += sample_where(self.ctx, step.rows)
        timer.decoding()
        decoded = self._decode(step)  # laid out again without pads if a padded decode failed
        if decoded is not None:
            self._steps += 1
            self._sampled_on_device += len(self.ctx.device_rows)
            self._advance(decoded.rows)  # cell bookkeeping, under the compute where llama_decode returns early (GPU)
            if any(r.row >= 0 for r in decoded.rows):
                self.ctx.synchronize()  # the outputs are read next anyway: the wait is the decode's
            # else nothing is read: the next step's admission, fill and graph build run under this step's compute
            # (llama.cpp waits for it before it copies that step's inputs, and before any read of the context)
        timer.sampling()
        if decoded is not None:
            self._sample(decoded.rows)
        times = timer.done()
        self._clock.add(times)
        if decoded is not None:
            self._account(decoded, times)
        return True

    def _account(self, step: StepBatch, times: StepTimes) -> None:
        """Count the micro-batches llama.cpp split this step's batch into; with a trace, write the step's line."""
        shape = step.shape
        micro = count_micro_batches(shape, self.ctx.params.n_ubatch, per_stream=not self.cache.shared)
        self._micro_batches += micro
        waited, self._placed_wait_s = self._placed_wait_s, 0.0
        if self.trace is None:
            return
        rows = step.rows
        prompt = [r.p1 - r.p0 for r in rows if r.choice is None]
        with self._lock:
            queued = len(self._queue)
        self.trace.record(StepRecord(
            t_s=times.start, admit_ms=1e3 * times.admit_s, fill_ms=1e3 * times.fill_s,
            decode_ms=1e3 * times.decode_s, sample_ms=1e3 * times.sample_s, host_cpu_ms=1e3 * times.host_cpu,
            tokens=sum(r.p1 - r.p0 for r in rows), decode_rows=len(rows) - len(prompt), prompt_tokens=sum(prompt),
            prompt_chunks=len(prompt), sequences=len({r.seq for r in rows}), micro_batches=micro,
            live=len(self._live), queued=queued, layout="unified" if self.cache.shared else "split",
            pads=len(step.pads), shape=[[slot, tokens] for slot, tokens in shape], waited_ms=1e3 * waited))

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, future = self._commands.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _reap(self, now: float) -> None:
        """End cancelled and expired requests, waiting or running."""
        def reason(stream: RequestStream) -> str | None:
            deadline = stream.request.deadline
            return "cancelled" if stream.cancelled else "deadline" if deadline is not None and now >= deadline \
                else None

        with self._lock:
            gone = [p for p in self._queue if reason(p.stream)]
            for pending in gone:
                self._queue.remove(pending)
        for pending in gone:
            pending.end(reason(pending.stream) or "cancelled")
        for live in [x for x in self._live if reason(x.stream)]:
            self._finish_all(live, reason(live.stream) or "cancelled")

    def _admit(self) -> None:
        """Waiting requests become live, in order, while slots and cells allow. Requests behind the queue's head that
        continue a history cached in a slot are placed ahead of it (:meth:`_admit_continuations`): first, until as
        many as the context has slots have passed it over, so that the head does not evict a history whose next turn
        is already queued (a hold, ``EngineConfig.hold_s``, covers only a turn yet to come, and a step can outlast
        it); and again when it is left waiting. Then prefilling requests whose prefix the head waits to share stop
        at its end this step (:func:`kvrt.runtime.admission.share_stops`)."""
        self._stops, self._hold_ends_in = {}, None
        with self._lock:
            head = self._queue.head()
        if head is not None and head.may_be_passed_over(self.cache.n_slots):
            self._admit_continuations(head)  # before the head is tried: it may evict what they continue
        while True:
            with self._lock:
                head = self._queue.head()
            if head is None:
                return
            if not self._admit_one(head, layout=True):
                break
        self._stops = share_stops(self.cache, head, self._live, self.config.prefill_chunk)
        self._admit_continuations(head)
        now = time.monotonic()
        hold_s = self._hold.seconds
        released = self.cache.next_release_after(now - hold_s)  # any held slot may be what head waits for
        self._hold_ends_in = None if released is None else released + hold_s - now

    def _admit_one(self, pending: Pending, *, layout: bool) -> bool:
        """Place ``pending``: True when it left the queue (placed, or refused with its error), False while it
        waits. ``layout``: the layout policy is asked first (the queue's head: it may need another layout)."""
        request = pending.stream.request
        try:
            if layout and not self._layout_policy.admits(request, self.cache, self.config, running=bool(self._live),
                                                         waiting=functools.partial(self._waiting_behind, pending),
                                                         waited_s=time.monotonic() - pending.queued_at):
                return False
            reserved = sum(live.future_cells() for live in self._live)
            prefilling = [x.request.prompt_array for x in self._live if x.prefilling]
            live = place(self.cache, self.model, pending, reserved, prefilling, hold_s=self._hold.seconds)
        except RequestTooLarge as exc:
            with self._lock:
                self._queue.take(pending)
            pending.end("error", exc)
            return True
        if live is None:
            return False
        with self._lock:
            self._queue.take(pending)
        self._placed_wait_s = max(self._placed_wait_s, time.monotonic() - pending.queued_at)
        self._reused += live.reused
        self._restored += live.restored
        if live.turnaround is not None:
            self._hold.observe(live.turnaround)
        self._live.append(live)
        if live.pin and not live.prefilling:  # its whole prompt was cached: no prefill row will ever land
            self._pin_slot(live)
            self._end(live)
        return True

    def _admit_continuations(self, head: Pending) -> None:
        """Each request behind ``head`` that continues a history cached in a slot (the next turn of a conversation,
        :meth:`PrefixCache.continued_by`) and fits the layout is placed: it takes that slot over in place and evicts
        nothing, so ``head`` (placed after them, or waiting for slots or for a slot held for such a turn,
        ``EngineConfig.hold_s``) does not cost the history. Each counts in ``head.passed_over``: once ``head`` has
        been passed over as many times as the context has slots, it is tried first and no slot is held from it (the
        continuations take only slots it could have had by evicting their histories; the bound keeps agents that
        never pause from holding them all)."""
        if self._layout_policy.switch_to is not None or self.cache.available_slots() == self.cache.free_slots():
            return  # the context is about to be recreated, or nothing cached can be continued
        with self._lock:
            behind = [p for p in self._queue if p is not head]
        for pending in behind:
            request = pending.stream.request
            if (not request.exact and fits_a_slot(request, self.cache)  # an exact one may reuse less: it would claim
                    and self.cache.continued_by(request.prompt_array) is not None
                    and self._admit_one(pending, layout=False)):
                head.passed_over += 1

    def _waiting_behind(self, head: Pending) -> list[Request]:
        """The requests queued behind ``head``, the next ``n_seq_max - 1`` in queue order (what a layout switch
        is chosen for, :class:`LayoutPolicy`)."""
        with self._lock:
            behind = (p.stream.request for p in self._queue if p is not head)
            return list(itertools.islice(behind, self.config.n_seq_max - 1))

    def _lay_out(self, *, pad: bool = True) -> StepBatch:
        """This step's batch, of the running requests (see :mod:`kvrt.runtime.step_layout`); ``pad``: pads may
        fill the split layout's idle slots between its sequences."""
        return self._filler.fill(self._live, self._steps, self.ctx, self.cache, pad=pad, stops=self._stops)

    def _decode(self, step: StepBatch) -> StepBatch | None:
        """``ctx.decode`` of the batch: the step decoded, or ``None`` when it failed and the requests in it did
        (nothing else is touched). The pads of the step are removed after it either way.

        Code 1 (no free cells; llama.cpp rolled its memory back) in the unified layout first evicts every
        unpinned cached prefix and tries once more (split: a slot's stream is its own, evicting others frees none
        of it). A batch with pads that fails is laid out again without them and tried once more: a pad must never
        be why a step's requests fail.
        """
        for attempt in range(2):
            try:
                self.ctx.decode(self.batch)
                self.cache.settled()
                return step
            except DecodeError as exc:
                if attempt == 0 and step.pads:
                    log.warning("a step with %d pads failed (%s); once more without them", len(step.pads), exc)
                    self.cache.unpad(step.pads)
                    step = self._lay_out(pad=False)
                    continue
                if attempt == 0 and exc.code == 1 and self.cache.shared and self.cache.evict_all():
                    continue
                for live in {id(r.live): r.live for r in step.rows}.values():
                    self._fail(live, exc)
                return None
            finally:
                self.cache.unpad(step.pads)
        return None

    def _advance(self, rows: list[Row]) -> None:
        """Mirror the decoded cells, share prompt chunks with the forks, run ``after_chunk`` hooks."""
        for r in rows:
            live = r.live
            if r.choice is not None:
                self.cache.appended(r.choice.slot, [r.choice.pending])  # type: ignore[list-item]
                r.choice.pos += 1
                self._decoded += 1
                continue
            self.cache.appended(live.slot, live.prompt[r.p0:r.p1], alone=len(rows) == 1)
            live.prefilled = r.p1
            self._prefilled += r.p1 - r.p0
            for choice in live.choices[1:]:
                self.cache.follow(live.slot, choice.slot, r.p0, r.p1, complete=not live.prefilling)
            if live.request.after_chunk is not None:
                try:
                    live.request.after_chunk(r.p0, r.p1)
                except Exception as exc:
                    self._fail(live, EngineError(f"after_chunk({r.p0}, {r.p1}) raised {exc!r}"))

    def _sample(self, rows: list[Row]) -> None:
        """Each row with logits is sampled by its choice(s); finished requests end.

        The rows of plain greedy choices are picked first, by one argmax over the step's logits.
        """
        greedy = greedy_picks(self.ctx, [(c.sampler, r.row) for r in rows if not r.live.ended
                                          for c in r.live.pickers(r.choice)])
        for r in rows:
            live = r.live
            if live.ended:
                continue
            if r.choice is not None:
                self._pick(live, r.choice, r.row, greedy)
            elif not live.prefilling and live.pin:
                self._pin_slot(live)
            elif not live.prefilling:
                for choice in live.choices:
                    choice.pos = len(live.prompt)
                    self._pick(live, choice, r.row, greedy)
            if live.done:
                self._end(live)

    def _pin_slot(self, live: Live) -> None:
        """A pin's prompt is in: its slot is kept cached until unpinned."""
        self.cache.release(live.slot)
        self.cache.pin(live.slot)
        self._pins[live.stream.id] = live.slot

    def _pick(self, live: Live, choice: Choice, row: int, greedy: dict[int, int]) -> None:
        token = greedy[row] if choice.sampler.plain_greedy else choice.sampler.sample(self.ctx, row)
        live.accept(choice, token, lambda: self.ctx.logits(row), self.cache)

    def _write_behind(self) -> bool:
        """With ``host_write_behind``, while nothing runs or waits, one cached slot is copied into the host tier's
        free room (:meth:`PrefixCache.back_up`), so the request that later evicts it does not wait for the copy.
        True when one was: the loop comes straight back, and a request arriving meanwhile waits for one slot's
        copy at most."""
        return (self.config.host_write_behind and not self._live and not self._queue
                and self._layout_policy.switch_to is None and self.cache.back_up())

    # -- the KV layout (auto: :mod:`kvrt.runtime.layout_policy` decides, the worker switches) ------------------
    def _switch(self, layout: Layout) -> None:
        """The worker recreates the context in ``layout``. If that fails, the request that needed a roomier
        layout is refused, or, where the layout it keeps holds that request (a return to the ``n_seq_max``
        streams, a switch away from one pool), the context keeps that layout for good."""
        start = time.perf_counter()
        try:
            self._relayout(layout)
        except KvrtError as exc:
            if layout == self.config.split_layout or self.cache.shared:  # the pool it kept holds the request
                log.warning("the context could not be made %s; it keeps its layout", layout, exc_info=True)
                self._layout_policy.split_failed()
                return
            with self._lock:
                pending = self._queue.head()
                if pending is not None:
                    self._queue.take(pending)
            if pending is not None:
                pending.end("error", RequestTooLarge(f"the request needs more than a slot's {self.cache.slot_cells} "
                                                     f"cells, and the context could not be made roomier: {exc}"))
        finally:
            self._relayout_s += time.perf_counter() - start

    def _relayout(self, layout: Layout) -> None:
        """Recreate the context in ``layout`` (nothing runs, nothing is pinned), dropping what it and the host
        tier cache (see the module docstring). On failure the previous layout is made again."""
        old = self.cache
        if old.host is not None:
            old.host.clear()
        self.ctx.close()  # first: the device holds one layout's cells at a time
        try:
            self.ctx = Context(self.model, self.config.context_params(layout))
        except KvrtError:
            self.ctx = Context(self.model, self.config.context_params(Layout(old.shared, old.n_slots)))
            self.cache = PrefixCache(self.ctx, old.host, unit=old.unit)
            raise
        self.cache = PrefixCache(self.ctx, old.host, unit=old.unit)
        self._relayouts += 1
        log.info("KV layout now %s: %d slots of %d cells", "unified" if layout.shared else "split",
                 self.cache.n_slots, self.cache.slot_cells)

    # -- endings ----------------------------------------------------------------------
    def _finish_all(self, live: Live, reason: str, error: KvrtError | None = None) -> None:
        live.finish_all(reason, self.cache)
        self._end(live, error)

    def _fail(self, live: Live, error: KvrtError) -> None:
        """A failed request ends with ``error``; its slots are emptied (their cells may be partial)."""
        if live.ended:
            return
        self._finish_all(live, "error", error)
        for slot in live.slots:
            if slot not in self.cache.pinned:
                self.cache.evict(slot, keep_copy=False)

    def _end(self, live: Live, error: KvrtError | None = None) -> None:
        if live.ended:
            return
        live.ended = True
        self._live.remove(live)
        if error is None:
            live.hand_state(self.ctx, self.cache)
        live.stream.push(live.end_event(error))

    def _fail_all(self, error: KvrtError, *, queued: bool = True) -> None:
        with self._lock:
            waiting = list(self._queue) if queued else []
            commands = list(self._commands) if queued else []
            if queued:
                self._queue.clear()
                self._commands.clear()
        for pending in waiting:
            pending.end("error", error)
        for _, future in commands:
            future.set_exception(error)
        for live in list(self._live):
            self._fail(live, error)

    def _unpin(self, pin_id: str) -> bool:
        slot = self._pins.pop(pin_id, None)
        if slot is None:
            return False
        self.cache.unpin(slot)
        return True
