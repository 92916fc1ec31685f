"""One engine step's batch: which tokens of which running requests it holds, in which rows, beside which pads.

What: :meth:`BatchFiller.fill` lays out a step of :class:`kvrt.runtime.batching.Engine`: the last sampled token of
every decoding choice, then prompt chunks of at most ``prefill_chunk`` tokens per request, round robin in slot order
from where the last step's chunks stopped, up to ``n_batch`` tokens (split layout: rows in slot order, so llama.cpp
computes consecutive streams together), a chunk
ending at its request's stop if the engine gave one (:func:`prompt_feed`). While an
``exact`` request prefills, the step holds one chunk of one of them (round robin) and nothing else: llama.cpp's CPU
kernels round by micro-batch shape, and this is the shape a cold prefill gives the chunk. In the split layout the
slots between the step's sequences may be filled, when that makes the step read fewer bytes a token
(:func:`fill_gaps`): an idle one with a throwaway token (a pad, see
:meth:`kvrt.runtime.prefix_cache.PrefixCache.padding`), a prefilling one the budget left out with a token of its
prompt; and prompt chunks of different lengths (the budget cut one short, a prompt ends) are capped at a shorter
one's length, or the last waits for the next step, when that reads fewer bytes a token (:func:`even_chunks`).
:func:`sample_where` then says, row by row, whether llama.cpp samples it in the decode's graph. In the split
layout, while prompt chunks fill whole steps, the decoding choices sit out the steps that come less than
``decode_wait_s`` after one that carried them (:meth:`BatchFiller._decodes_now`).

Why apart: how a step is packed (chunks, turns, pads, the bytes a step reads) is decided from the running requests
and the cache's slots alone; the engine decodes what it gets, and this is the one place that packing is read or
changed.

Invariants: decode tokens go first in a step that carries them, so a long prompt delays them by at most
``decode_wait_s`` and a step; pads and gap tokens take budget from prompt chunks only; they are added only when
they lower the step's bytes read a token, and pads never cost a row: at most they shorten the last prompt chunk, by
fewer tokens than it has. Pads exist in the context only between the fill and the decode: the caller removes them
(:meth:`PrefixCache.unpad`) after the decode, failed or not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.decode_step import Feed, fill, takes
from kvrt.engine.geometry import ModelGeometry
from kvrt.engine.micro_batches import read_bytes
from kvrt.engine.model import Model
from kvrt.runtime.live import Choice, Live
from kvrt.runtime.prefix_cache import PrefixCache


@dataclass(frozen=True)
class Row:
    """One request's part of a step's batch: a decode token of ``choice``, or prompt positions [p0, p1);
    ``row`` is its logits row (-1: a prompt chunk that is not the last, or a pin's)."""

    live: Live
    row: int
    choice: Choice | None = None
    p0: int = 0
    p1: int = 0

    @property
    def seq(self) -> int:
        return self.choice.slot if self.choice is not None else self.live.slot


@dataclass(frozen=True)
class StepBatch:
    """What one step's batch holds: the requests' rows, in the order they were chosen, and the pads beside them."""

    rows: list[Row]
    pads: list[Feed]

    @property
    def shape(self) -> list[tuple[int, int]]:
        """(slot, tokens) of every sequence in the batch, pads included, in slot order (fill's ``by_seq`` order;
        unified, any order counts alike): what llama.cpp splits into micro-batches."""
        return sorted([(r.seq, r.p1 - r.p0) for r in self.rows] + [(pad.seq, 1) for pad in self.pads])


class BatchFiller:
    """Lays out steps into ``batch`` (see the module docstring); ``model`` gives the bytes a step reads (its
    weights, and a cell's K/V) that decide whether pads and evened chunks pay off; ``decode_wait_s``: how long
    decode rows may sit out steps that prompt chunks fill, timed by ``clock``."""

    def __init__(self, batch: Batch, model: Model, *, chunk: int, pad_gaps: bool, even_chunks: bool,
                 decode_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.batch = batch
        self.chunk = chunk
        self.pad_gaps = pad_gaps
        self.even_chunks = even_chunks
        self.decode_wait_s = decode_wait_s
        self._clock = clock
        self._decoded_at = -math.inf  # when a step last carried decode rows
        self._decision = (-1, True)  # the last step asked about, and whether it carried them
        self._resume_at = 0  # the slot after the last one a prompt chunk went to
        self._turn_start = (-1, 0)  # the last step laid out, and the slot its prompt chunks began from
        geometry = ModelGeometry(model.n_layer, model.n_embd, model.n_head, model.n_head_kv, model.n_vocab)
        self._weight_bytes, self._cell_bytes = model.size_bytes, geometry.kv_bytes_per_token()

    def fill(self, running: Sequence[Live], turn: int, ctx: Context, cache: PrefixCache, *,
             pad: bool = True, stops: Mapping[int, int] | None = None) -> StepBatch:
        """The step of the ``running`` requests (in admission order), written into the batch. ``turn`` (the step
        count) tells a step laid out again from a new one (:meth:`_in_turn`), and picks which exact request
        prefills alone; ``pad``: pads may be added (with ``pad_gaps``); ``stops``: slot -> the prompt position its
        request's chunk ends at, at the latest (:func:`kvrt.runtime.admission.share_stops`)."""
        prefilling = [live for live in running if live.prefilling]
        exact = [live for live in prefilling if live.request.exact]
        chunk, budget = self.chunk, ctx.n_batch
        decoders = [] if exact else [(live, choice, Feed(choice.slot, choice.pos, (choice.pending,)))
                                     for live in running for choice in live.choices if choice.pending is not None]
        prefilling = ([exact[turn % len(exact)]] if exact
                      else self._in_turn(turn, prefilling, room=budget - len(decoders)))
        prompts = [prompt_feed(live, (stops or {}).get(live.slot)) for live in prefilling]
        if decoders and not self._decodes_now(turn, prompts, budget, shared=cache.shared):
            decoders = []
        owners: list[tuple[Live, Choice | None]] = [*((live, choice) for live, choice, _ in decoders),
                                                    *((live, None) for live in prefilling)]
        feeds = [feed for _, _, feed in decoders] + prompts
        decoding = len(decoders)
        if self.even_chunks and not cache.shared and not exact:
            chunk, budget = even_chunks(feeds, decoding, budget=budget, chunk=chunk, ubatch=ctx.params.n_ubatch,
                                        cost=lambda shape: self._read_bytes(shape, ctx, cache))
        pads: list[Feed] = []
        if pad and self.pad_gaps and not exact and not cache.shared:
            order, feeds, pads = fill_gaps(feeds, decoding, budget=budget, chunk=chunk, padding=cache.padding,
                                           cost=lambda shape: self._read_bytes(shape, ctx, cache))
            owners = [owners[i] for i in order]
        landed = fill(self.batch, feeds[:decoding] + pads + feeds[decoding:], budget=budget, chunk=chunk,
                      by_seq=not cache.shared)
        landed = landed[:decoding] + landed[decoding + len(pads):]
        rows = [Row(live, -1 if part.row is None else part.row, choice, part.p0, part.p1)
                for (live, choice), part in zip(owners, landed)]
        if len(rows) > decoding:
            self._resume_at = rows[-1].seq + 1
        return StepBatch(rows, pads)

    def _in_turn(self, turn: int, prefilling: list[Live], *, room: int) -> list[Live]:
        """The prefilling requests in the order step ``turn`` offers them the budget: by slot, cyclically, from
        the first at or after the slot past the last one the previous step gave a chunk, unless the requests from
        there to the last slot leave ``room`` (the step's tokens, less its decode rows at most) for requests
        before it: then from as far before it as fills the room, so the chunks end at the last slot (the same for
        a step laid out again).

        Why slot order: in the split layout llama.cpp computes only a run of consecutive slots in one micro-batch,
        so 15 next-turn prompts chosen in arrival order from 32 slots split into 8 or 9 micro-batches where a run
        of slots takes 4 (an H100 swarm trace). Why from where the last step stopped: each request waits at most
        one pass over the others, as in a round robin (those just before the pointer may get a second chunk). Why
        not past the last slot: a step's chunks in slots 6, 7, 0 and 1 are two runs, a micro-batch each (the CPU
        swarm: 512 tokens in 1.11 s, against 0.48 s for 256 in one run); starting again from the first slot instead
        would leave the last ones waiting for every prompt before them."""
        by_slot = sorted(prefilling, key=lambda live: live.slot)
        if self._turn_start[0] != turn:
            wants = [min(len(live.prompt) - live.prefilled, self.chunk) for live in by_slot]
            first = next((i for i, live in enumerate(by_slot) if live.slot >= self._resume_at), 0)
            while first > 0 and sum(wants[first:]) < room:
                first -= 1
            self._turn_start = (turn, by_slot[first].slot if by_slot else 0)
        first = next((i for i, live in enumerate(by_slot) if live.slot >= self._turn_start[1]), 0)
        return by_slot[first:] + by_slot[:first]

    def _decodes_now(self, turn: int, prompts: Sequence[Feed], budget: int, *, shared: bool) -> bool:
        """Whether step ``turn`` carries the decoding choices' rows: always, unless the layout is split, the
        ``prompts`` fill the step's ``budget`` without them and a step carried them less than ``decode_wait_s``
        ago (then they sit this step out). The step laid out again (without pads, after a failed decode) gets the
        same answer.

        Why: llama.cpp gives every sequence of a micro-batch the same number of tokens, so in the split layout
        decode rows beside prompt chunks cost a pass over all the weights of their own; while prompts keep the
        steps full, decoding every few steps instead of every step finishes the prompts sooner. 0 decodes every
        step (llama-server's and vLLM's order); a long wait gives prompts the GPU first (SGLang's)."""
        if self._decision[0] == turn:
            return self._decision[1]
        now = self._clock()
        prompt_work = sum(min(feed.left, self.chunk) for feed in prompts)
        decodes = shared or prompt_work < budget or now - self._decoded_at >= self.decode_wait_s
        if decodes:
            self._decoded_at = now
        self._decision = (turn, decodes)
        return decodes

    def _read_bytes(self, shape: list[tuple[int, int]], ctx: Context, cache: PrefixCache) -> int:
        """:func:`kvrt.engine.micro_batches.read_bytes` of a step of ``shape`` ((slot, tokens), in slot order): a pad
        pays off when it joins runs (one weight pass fewer) without lengthening a run's attention by more."""
        return read_bytes(shape, ctx.params.n_ubatch, cache.held, self._weight_bytes, self._cell_bytes)


def fill_gaps(feeds: Sequence[Feed], decoding: int, *, budget: int, chunk: int,
              padding: Callable[[list[int]], list[Feed]], cost: Callable[[list[tuple[int, int]]], int]
              ) -> tuple[list[int], list[Feed], list[Feed]]:
    """A split-layout step of ``feeds`` (the first ``decoding`` of them one-token decode feeds) with the slots
    between its sequences filled, when that reads the fewest bytes a request's token (``cost``: the bytes a step of
    a shape, (slot, tokens) in slot order, reads): as given; with pads (``padding``: a throwaway token for each idle
    slot between the given ones, :meth:`PrefixCache.padding`); or with, besides the pads, a prompt token for each
    prefilling feed the budget left out, moved after the decode feeds (taking budget from the last chunks). Returns
    the feeds' order (indices into ``feeds``), the feeds in it and the pads, which go after the decode feeds and
    never cost a prompt chunk its last token.

    Why: llama.cpp puts only consecutive sequence ids in one micro-batch, and each reads all the weights: 16 decode
    rows among 12 prefilling slots waiting for budget split into 12 micro-batches where one run of all 32 slots
    makes 5 (an H100 trace: 150 against ~90 ms a step)."""
    def pads_for(fed: list[Feed]) -> list[Feed]:
        chosen = takes(fed, budget=budget, chunk=chunk)
        pads = padding([feed.seq for feed, _ in chosen])
        squeezed = len(pads) - (budget - sum(take for _, take in chosen))  # prompt tokens the pads take
        return [] if squeezed > 0 and (len(chosen) == decoding or squeezed >= chosen[-1][1]) else pads

    def per_token(option: tuple[list[int], list[Feed], list[Feed]]) -> float:
        _, fed, pads = option
        chosen = takes([*fed[:decoding], *pads, *fed[decoding:]], budget=budget, chunk=chunk)
        return _bytes_per_token(chosen, cost, throwaway=len(pads))

    given = list(range(len(feeds)))
    options = [(given, list(feeds), []), (given, list(feeds), pads_for(list(feeds)))]
    seqs = [feed.seq for feed, _ in takes(feeds, budget=budget, chunk=chunk)]
    waiting = {i for i in range(len(seqs), len(feeds)) if seqs and min(seqs) < feeds[i].seq < max(seqs)}
    if not options[1][2] and not waiting:  # no gap to fill (e.g. every slot decoding): nothing to compare
        return options[0]
    if waiting:
        order = [*range(decoding), *sorted(waiting), *(i for i in range(decoding, len(feeds)) if i not in waiting)]
        filled = [feeds[i].until(feeds[i].done + 1) if i in waiting else feeds[i] for i in order]
        options.append((order, filled, pads_for(filled)))
    return min(options, key=per_token)  # the first of equals: the layout as given


def prompt_feed(live: Live, stop: int | None = None) -> Feed:
    """The rest of ``live``'s prompt as a feed, cut at ``stop`` when that lies inside it (then without logits: the
    prompt goes on in a later step). A ``stop`` at or before what is prefilled is ignored, so the feed never comes
    out empty: :func:`kvrt.engine.decode_step.fill` stops at the first feed that gets no token."""
    feed = Feed(live.slot, 0, live.prompt, logits=not live.pin, done=live.prefilled)
    return feed.until(stop) if stop is not None and live.prefilled < stop < len(live.prompt) else feed


def even_chunks(feeds: Sequence[Feed], decoding: int, *, budget: int, chunk: int, ubatch: int,
                cost: Callable[[list[tuple[int, int]]], int]) -> tuple[int, int]:
    """The ``(chunk, budget)`` to fill a split-layout step of ``feeds`` (the first ``decoding`` of them one-token
    decode feeds) with, whichever reads the fewest bytes a token (``cost``: the bytes a step of a shape, (slot,
    tokens) in slot order, reads): as given, or its prompt chunks capped at a length that splits evenly, either with
    the budget cut to exactly what the capped chunks take (no further chunk joins the step with the tokens freed)
    or with the whole budget (they go to the chunks after them). The caps tried: each chunk's length (the budget
    cut the last one short, or a prompt ends inside its chunk), and the longest one's rounded down to a multiple of
    ``ubatch // r`` for each number ``r`` of prompts that may run together (llama.cpp gives each of ``r``
    consecutive sequences ``ubatch // r`` tokens of a micro-batch); and, when the last chunk is the shortest, the
    others alone, capped at each of their lengths.

    Why: llama.cpp gives every sequence of a micro-batch the same number of tokens, so prompt chunks of 512, 512,
    512 and 511 (a decode row took one token of a 2,048 budget) split into six micro-batches where four of 511 make
    five, and three chunks of 512 in consecutive slots into 3 x 170 and 3 x 2 where three of 510 make three; each
    micro-batch is a pass over all the weights (GPU traces: 110 against 91 ms a step); and 32 prompts of 129 tokens
    (an agent's next turn) in a 2,048 budget take 16 x 128 in four micro-batches, where 15 x 129 and 113 take five."""
    def per_token(option: tuple[int, int]) -> float:
        cap, room = option
        return _bytes_per_token(takes(feeds, budget=room, chunk=cap), cost)

    def capped(lengths: list[int], caps: set[int]) -> list[tuple[int, int]]:
        """The options of a step of chunks of these lengths: each cap, with the budget the chunks then take."""
        return [(cap, decoding + sum(min(take, cap) for take in lengths)) for cap in sorted(caps - {0})]

    lengths = [take for _, take in takes(feeds, budget=budget, chunk=chunk)[decoding:]]
    if not lengths:
        return chunk, budget
    longest = max(lengths)
    caps = set(lengths) | {longest // (ubatch // r) * (ubatch // r) for r in range(1, len(feeds) - decoding + 1)}
    options = [(chunk, budget), *capped(lengths, caps), *((cap, budget) for cap in sorted(caps - {0, chunk}))]
    if len(lengths) > 1 and lengths[-1] < min(lengths[:-1]):  # a cut or ending last chunk may wait instead
        options += capped(lengths[:-1], set(lengths[:-1]))
    return min(options, key=per_token)  # the first of equals: the layout as given


def _bytes_per_token(chosen: Sequence[tuple[Feed, int]], cost: Callable[[list[tuple[int, int]]], int], *,
                     throwaway: int = 0) -> float:
    """What a step of ``chosen`` (feeds and the tokens each gives, as :func:`takes` returns them) reads by ``cost``
    (of its shape, (slot, tokens) in slot order), per token of the requests: ``throwaway`` of its tokens are
    pads. How :func:`fill_gaps` and :func:`even_chunks` compare the layouts they choose between."""
    tokens = sum(take for _, take in chosen) - throwaway
    return cost(sorted((feed.seq, take) for feed, take in chosen)) / tokens if tokens > 0 else math.inf


def sample_where(ctx: Context, rows: Sequence[Row]) -> int:
    """With ``backend_sampling`` (the caller asks only then): each row with logits is set to be sampled in the
    decode's graph when all its pickers are plain greedy and no logprobs are asked (only the picked token comes
    back), else on the host from its copied logits. A slot keeps its setting until a request on it needs the
    other: each change makes llama.cpp reserve its graphs again. Returns how many slots changed."""
    switches = 0
    on_device = ctx.sampled_on_device  # a step's rows are in distinct slots: one look for all of them
    for r in rows:
        if r.row < 0:
            continue
        pickers = [r.choice] if r.choice is not None else r.live.choices
        greedy = r.live.request.logprobs is None and all(c.sampler.plain_greedy for c in pickers)
        if greedy != (r.seq in on_device):
            ctx.sample_on_device(r.seq, greedy)
            switches += 1
    return switches
