"""The sequence slots of one context, kept as a cache of token prefixes.

A context has ``n_seq_max`` slots (llama.cpp sequences) laid out one of two ways:

* **shared** (``kv_unified=True``): one pool of ``n_ctx`` cells. Slots share a
  prefix by sharing its cells (``seq_cp`` is metadata only), but every sequence's
  attention spans every used cell of the pool, its own or not.
* **split** (``kv_unified=False``): one stream of ``n_ctx / n_seq_max`` cells per
  slot. A sequence attends over its own stream only; sharing a prefix copies the
  source's whole stream (``seq_cp`` across streams, done by llama.cpp on the device at
  the next decode) and drops what is not shared (``seq_rm``).

Every slot is ``free`` (holds nothing), ``active`` (a running sequence writes into it)
or ``cached`` (a finished sequence left its cells there, so a later request that starts
with the same tokens needs to prefill only the rest). Cached slots are evicted least
recently used first, those no agent owns before any agent's (a cached slot is owned by the
agent whose request left it, :attr:`kvrt.runtime.requests.Request.agent`: an agent's history
outlives anonymous prefixes); a ``pinned`` slot is cached and never evicted (:class:`kvrt.prefixes.Eviction`,
the policy every tier shares, with an agent's slots one priority above anonymous ones).

:class:`PrefixCache` is the only code that changes the context's memory for the
engine, and it mirrors each change exactly: a decoded row makes one new cell, a shared
``seq_cp`` makes the destination share the source's cells and a split one gives it
copies, ``seq_rm`` drops a slot's claim and a cell without claims is free (what
llama.cpp's cache does; :class:`kvrt.runtime.cell_claims.CellClaims` keeps the cells and their
claims). So :attr:`used_cells` is the real count of occupied cells, computed without asking
llama.cpp, and admission can decide exactly what eviction would free. Invariant of the split
layout: a stream copy is pending from ``seq_cp`` until the next successful decode
(:meth:`settled`), so until then no slot it reads or writes is restored from or copied to the
host (their device data is not what the mirror says yet).

With a :class:`kvrt.runtime.host_tier.HostTier` an evicted slot's state is first copied
to host memory, unless :meth:`PrefixCache.back_up` copied it while the engine had nothing
to decode (write-behind: the copy leaves the admission of the request that evicts it);
:meth:`PrefixCache.restore` brings such a copy back into a slot.

Each slot also records how many of its first positions were computed *cold*: in the
micro-batches a prefill of its tokens alone, from position 0, puts them in (whole
``unit`` s, :attr:`kvrt.runtime.admission.EngineConfig.prefill_unit`, of prompt chunks that
each had a step to themselves, from an aligned start). llama.cpp's CPU kernels round
differently by micro-batch shape, so only those positions hold the KV a cold prefill
would compute; an ``exact`` request reuses no more than that (:meth:`cold_prefix`).
Copies, restores and host copies carry the count; a truncation cuts it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Iterable, Sequence, Set
from typing import Literal

import numpy as np

from kvrt.engine.context import Context
from kvrt.engine.decode_step import Feed
from kvrt.errors import KvrtError
from kvrt.prefixes import Eviction, TokenIds
from kvrt.runtime.cell_claims import CellClaims
from kvrt.runtime.host_tier import HostEntry, HostTier, owner_priority
from kvrt.runtime.slot_tokens import SlotTokens

log = logging.getLogger(__name__)

SlotState = Literal["free", "active", "cached"]


class PrefixCache:
    """Slot states, the tokens each slot's cells hold, and the cells they share."""

    def __init__(self, ctx: Context, host: HostTier | None = None, *, unit: int = 1) -> None:
        if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
            raise KvrtError(f"PrefixCache unit must be a positive integer, got {unit!r}")
        self.ctx = ctx
        self.host = host
        self.unit = unit  # positions count as computed cold in whole units from 0 (EngineConfig.prefill_unit)
        self.shared = ctx.params.kv_unified or ctx.n_seq_max == 1  # one pool of cells (else a stream per slot)
        self.n_cells = ctx.n_ctx
        self.slot_cells = ctx.n_ctx_seq  # the most one slot can hold: the pool, or its own stream
        self.n_slots = ctx.n_seq_max
        self._unsettled: set[int] = set()  # split: slots a pending stream copy reads or writes
        self.state: list[SlotState] = ["free"] * self.n_slots
        self._tokens = SlotTokens(self.n_slots)
        self._cells = CellClaims(self.n_slots, self.n_cells)  # each slot's cells, and who claims each cell
        self._cold = [0] * self.n_slots  # each slot's first positions computed as a cold prefill computes them
        self._eviction: Eviction[int] = Eviction()  # the cached slots (pinned ones never chosen), LRU first
        self._owner: list[str | None] = [None] * self.n_slots  # the agent whose history a slot holds
        self._released_at = [-math.inf] * self.n_slots  # when each slot last became cached (time.monotonic)

    # -- queries ----------------------------------------------------------------------
    @property
    def pinned(self) -> Set[int]:
        """The pinned slots (cached, never evicted)."""
        return self._eviction.pins

    @property
    def used_cells(self) -> int:
        return self._cells.used

    def tokens(self, slot: int) -> list[int]:
        """The tokens whose KV the slot holds, position by position (a copy)."""
        tokens: list[int] = self._tokens.view(slot).tolist()
        return tokens

    def longest_prefix(self, tokens: TokenIds, *, cold: bool = False) -> tuple[int | None, int]:
        """The active, cached or pinned slot sharing the longest prefix with ``tokens``, and its length
        (``cold``: only the part it computed cold counts, see :meth:`cold_prefix`).

        An active slot only grows, so its first cells are as good a source as a cached one.
        """
        best, best_len = None, 0
        shared = self._tokens.common_prefixes(np.asarray(tokens, dtype=np.int64))
        for slot in range(self.n_slots):
            if self.state[slot] != "free":
                length = int(shared[slot])
                if cold:
                    length = self.cold_prefix(slot, length)
                if length > best_len:
                    best, best_len = slot, length
        return best, best_len

    def cold_prefix(self, slot: int, length: int) -> int:
        """How much of the slot's first ``length`` positions a request may reuse and still get a cold prefill's
        logits: the positions computed cold, in whole units."""
        return min(length, self._cold[slot]) // self.unit * self.unit

    def held(self, slot: int) -> int:
        """How many positions the slot holds."""
        return self._tokens.length(slot)

    def reusable(self, slot: int) -> bool:
        """Whether the slot is cached and unpinned: a request may take it over or evict it."""
        return slot in self._eviction and not self._eviction.pinned(slot)

    def free_slots(self) -> int:
        return self.state.count("free")

    def released_at(self, slot: int) -> float:
        """When the slot's last sequence finished and left it cached (``time.monotonic``; -inf: never)."""
        return self._released_at[slot]

    def next_release_after(self, since: float) -> float | None:
        """The earliest :meth:`released_at` later than ``since`` among the unpinned cached slots (``None``: none):
        with ``since = now - hold_s``, the slot whose hold (``EngineConfig.hold_s``) ends first."""
        return min((t for slot in self._eviction if (t := self._released_at[slot]) > since), default=None)

    def continued_by(self, tokens: np.ndarray) -> int | None:
        """The unpinned cached slot whose every token begins ``tokens`` (int64), with more to come: a
        conversation's next turn finding its history where the last turn left it (``None``: no such slot)."""
        for slot in self._eviction:  # the unpinned cached slots: few while many requests run
            held = self.held(slot)
            if 0 < held < len(tokens) and self._tokens.begins_with(slot, tokens[:held]):
                return slot
        return None

    def owner(self, slot: int) -> str | None:
        """The agent whose history the slot holds (``None``: anonymous, or free)."""
        return self._owner[slot]

    def next_victim(self, avoid: int | None = None) -> int | None:
        """The cached slot :meth:`claim` would evict first, if any: unpinned, the least recently used of those no
        agent owns, else the least recently used agent's (``avoid``: never that one)."""
        return self._eviction.victim(avoid=avoid)

    def available_slots(self) -> int:
        """Slots a new request could claim: free, or cached and not pinned."""
        return sum(1 for s in range(self.n_slots) if self.state[s] == "free" or self.reusable(s))

    def cells_if_evicted(self, keep: tuple[int, int] | None = None) -> int:
        """Free cells if every unpinned cached slot were emptied (``keep``: a slot's first cells that survive)."""
        kept = [slot for slot in range(self.n_slots) if self.state[slot] == "active" or slot in self.pinned]
        return self.n_cells - self._cells.distinct(kept, keep)

    def pinned_cells(self) -> int:
        """Cells held by pinned slots (never evicted)."""
        return self._cells.distinct(self.pinned)

    # -- changes (each mirrors one llama.cpp memory call) ------------------------------
    def claim(self, avoid: int | None = None) -> int | None:
        """An empty slot made active: a free one, else the unpinned cached slot :meth:`next_victim` names
        (other than ``avoid``) emptied; ``None`` when there is none."""
        slot = next((s for s in range(self.n_slots) if self.state[s] == "free"), None)
        if slot is None:
            slot = self.next_victim(avoid)
            if slot is None:
                return None
            self.evict(slot)
        self.state[slot] = "active"
        return slot

    def take_over(self, slot: int, keep: int) -> None:
        """Make an unpinned cached slot active again, keeping only its first ``keep`` positions. A cut of more than
        half of it is an eviction in all but name: its state is first copied to the host tier as :meth:`evict`
        copies it (a new request continuing the slot a claim would evict, for the few tokens they share)."""
        if not self.reusable(slot):
            raise KvrtError(f"slot {slot} is {self.state[slot]}{' and pinned' if slot in self.pinned else ''}; "
                            "only an unpinned cached slot can be taken over")
        if 2 * keep < self.held(slot) and self._worth_a_copy(slot):
            self._copy_to_host(slot)
        self._eviction.discard(slot)
        self.state[slot] = "active"
        self.truncate(slot, keep)

    def copy_prefix(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst`` (holding exactly ``p0`` positions) gets ``src``'s positions [p0, p1): their cells when
        shared; in the split layout a copy of ``src``'s stream cut at ``p1``, so ``p0`` must be 0."""
        if self.held(dst) != p0 or self.held(src) < p1 or (p0 > 0 and not self.shared):
            raise KvrtError(f"cannot share positions [{p0}, {p1}) of slot {src} ({self.held(src)} held) "
                            f"onto slot {dst} ({self.held(dst)} held)"
                            f"{'' if self.shared else '; one stream per slot copies a prefix whole, from 0'}")
        if p1 <= p0:
            return
        if self.shared:
            self.ctx.seq_cp(src, dst, p0, p1)
            self._cells.share(src, dst, p0, p1)
            self._tokens.extend(dst, self._tokens.view(src, p1)[p0:])
        else:
            self.ctx.seq_cp(src, dst)  # the whole stream, copied on the device at the next decode
            if p1 < self.held(src):
                self.ctx.seq_rm(dst, p1, -1)
            self._unsettled.update((src, dst))
            self.appended(dst, self._tokens.view(src, p1))
        if self._cold[dst] == p0:  # the copied positions are as cold as they were in the source
            self._cold[dst] = max(p0, min(self._cold[src], p1))

    def follow(self, src: int, dst: int, p0: int, p1: int, *, complete: bool) -> None:
        """A fork ``dst`` keeps up with the prompt ``src`` is prefilling, whose positions [p0, p1) just landed
        (``complete``: the prompt is all in). Shared: those cells now; split: the whole prompt once complete."""
        if self.shared:
            self.copy_prefix(src, dst, p0, p1)
        elif complete:
            self.copy_prefix(src, dst, 0, p1)

    def unsettled(self, slot: int) -> bool:
        """Whether a stream copy the next decode does reads or writes the slot (its device data is not the
        mirror's yet)."""
        return slot in self._unsettled

    def hand_over(self, owner: str) -> tuple[tuple[int, ...], np.ndarray] | None:
        """Take ``owner``'s history out of this cache, to go into another engine: the tokens and llama.cpp sequence
        state of the unpinned cached slot it owns that holds the most (else of its longest host copy); that slot
        evicted without a host copy and its host copies dropped. ``None`` when it holds nothing here."""
        slots = [s for s in range(self.n_slots) if self._owner[s] == owner and self.reusable(s)]
        host = self.host.pop_owned(owner) if self.host is not None else None
        if not slots:
            return host
        slot = max(slots, key=self.held)
        state = np.empty(self.ctx.seq_state_size(slot), dtype=np.uint8)
        written = self.ctx.seq_state_get(slot, state)
        taken = tuple(self.tokens(slot)), state[:written]
        for other in slots:
            self.evict(other, keep_copy=False)
        return taken

    def padding(self, seqs: Collection[int]) -> list[Feed]:
        """Split layout: a throwaway token (id 0, no logits) at the next position of every slot between the lowest
        and highest of ``seqs`` that is not among them and can take one: free or cached, no stream copy pending,
        a cell left in its stream. Why: llama.cpp puts only consecutive sequence ids in one micro-batch
        (:mod:`kvrt.engine.micro_batches`), and every micro-batch reads all the weights, so 16 decode rows in
        every other slot cost 8 of them; padded, one. :meth:`unpad` must follow the decode: the mirror never
        records a pad (a slot's cells after ``unpad`` are the ones it had)."""
        if self.shared or not seqs:
            return []
        present = set(seqs)
        return [Feed(slot, self.held(slot), (0,), logits=False)
                for slot in range(min(present) + 1, max(present))
                if slot not in present and self.state[slot] != "active" and slot not in self._unsettled
                and self.held(slot) < self.slot_cells]

    def unpad(self, pads: Iterable[Feed]) -> None:
        """Remove what :meth:`padding`'s tokens wrote (each at its slot's next position, so only it goes); after a
        failed decode too, where it may not have been written (the removal then removes nothing)."""
        for pad in pads:
            self.ctx.seq_rm(pad.seq, pad.pos, -1)

    def settled(self) -> None:
        """A decode succeeded: llama.cpp has done every pending stream copy."""
        self._unsettled.clear()

    def appended(self, slot: int, tokens: Sequence[int] | np.ndarray, *, alone: bool = False) -> None:
        """Record that a decode wrote ``tokens`` at the slot's next positions (one new cell each).

        ``alone``: they were a prompt chunk with the step to itself; from a start that is cold and whole units
        from 0, its whole units count as computed cold (a cold prefill cuts the same micro-batches there).
        """
        start = self.held(slot)
        if alone and self._cold[slot] == start and start % self.unit == 0:
            self._cold[slot] = start + len(tokens) // self.unit * self.unit
        self._tokens.extend(slot, tokens)
        self._cells.append(slot, len(tokens))

    def truncate(self, slot: int, keep: int) -> None:
        """Drop the slot's positions from ``keep`` on (``seq_rm``)."""
        if keep >= self.held(slot):
            return
        self.ctx.seq_rm(slot, keep, -1)
        self._cells.truncate(slot, keep)
        self._tokens.truncate(slot, keep)
        self._cold[slot] = min(self._cold[slot], keep)

    def release(self, slot: int, *, owner: str | None = None) -> None:
        """An active slot's sequence is done: its cells stay cached for later prefixes (most recently used), as
        ``owner``'s history (``None``: anonymous)."""
        if self.state[slot] != "active":
            raise KvrtError(f"slot {slot} is {self.state[slot]}, not active")
        self._owner[slot] = owner
        if not self.held(slot):
            self.state[slot] = "free"
            return
        self.state[slot] = "cached"
        self._released_at[slot] = time.monotonic()
        self._eviction.add(slot, priority=owner_priority(owner))

    def host_prefix(self, tokens: TokenIds, *, cold: bool = False) -> tuple[HostEntry | None, int]:
        """The host copy sharing the longest prefix with ``tokens`` and its length (``(None, 0)`` without a tier;
        ``cold``: only what the copy holds computed cold counts, in whole units)."""
        if self.host is None:
            return None, 0
        return self.host.longest(tokens, cold_unit=self.unit if cold else 0)

    def restore(self, slot: int, entry: HostEntry, keep: int) -> bool:
        """Load a host copy into an empty active slot and keep its first ``keep`` positions; False (the slot
        left empty) when llama.cpp refuses it, e.g. with no run of free cells long enough."""
        if self.state[slot] != "active" or self.held(slot):
            raise KvrtError(f"a host copy is restored into an empty active slot; slot {slot} is {self.state[slot]} "
                            f"holding {self.held(slot)} positions")
        if slot in self._unsettled:  # a pending stream copy would overwrite (or read) what the restore writes
            return False
        try:
            self.ctx.seq_state_set(entry.state, slot)
        except KvrtError as exc:
            log.debug("host copy of %d tokens not restored into slot %d: %s", len(entry.tokens), slot, exc)
            return False
        self.appended(slot, entry.tokens)
        self._cold[slot] = entry.cold
        self.truncate(slot, keep)
        return True

    def evict(self, slot: int, *, keep_copy: bool = True) -> None:
        """Empty a slot (``seq_rm`` of all of it); it becomes free. With a host tier and ``keep_copy`` its
        state is copied there first (a failed request's slot is not: its cells may be partial)."""
        if slot in self.pinned:
            raise KvrtError(f"slot {slot} is pinned; unpin it before evicting it")
        if keep_copy and self._worth_a_copy(slot):
            self._copy_to_host(slot)
        self._eviction.discard(slot)
        self.ctx.seq_rm(slot)  # also when the mirror holds nothing: a failed decode may have left cells
        self._cells.truncate(slot, 0)
        self._tokens.truncate(slot, 0)
        self._cold[slot] = 0
        self._owner[slot] = None
        self.state[slot] = "free"

    def evict_until(self, free_cells: int) -> bool:
        """Evict least recently used unpinned cached slots until ``free_cells`` cells are free (split: every
        slot has its own cells, so there is nothing to free for another)."""
        while self.shared and self.n_cells - self.used_cells < free_cells:
            victim = self.next_victim()
            if victim is None:
                return False
            self.evict(victim)
        return True

    def evict_all(self) -> int:
        """Evict every unpinned cached slot; returns how many there were."""
        slots = list(self._eviction)
        for slot in slots:
            self.evict(slot)
        return len(slots)

    def pin(self, slot: int) -> None:
        """Keep a cached slot's cells until :meth:`unpin` (it is never evicted meanwhile)."""
        if self.state[slot] != "cached":
            raise KvrtError(f"only a cached slot can be pinned; slot {slot} is {self.state[slot]}")
        self._eviction.pin(slot)

    def unpin(self, slot: int) -> None:
        """The slot becomes an ordinary cached slot, evictable, most recently used."""
        if slot in self._eviction:
            self._eviction.unpin(slot)

    def back_up(self) -> bool:
        """Write-behind, for an engine with nothing to decode: copy the cached slot that is next in eviction order
        and has no host copy yet into the host tier's free room (no entry leaves for it), so that its eviction
        later finds the copy made (:meth:`HostTier.keep`) and costs a ``seq_rm`` only. True when one was copied.
        Invariant: a copy is of a slot's whole settled state, so it is exactly what an eviction would copy."""
        if self.host is None:
            return False
        for slot in self._eviction:
            tokens = self._tokens.view(slot)
            if (slot not in self._unsettled
                    and not self.host.holds(tokens, cold=self._cold[slot], owner=self._owner[slot])
                    and self._worth_a_copy(slot)):
                return self._copy_to_host(slot, make_room=False)
        return False

    def _worth_a_copy(self, slot: int) -> bool:
        """Whether the slot's state is worth a host copy: a host tier keeps prefixes this long, and no other slot
        or host copy holds half of it or more.

        Why: the copy is of the slot's whole state, so slots that share a long prefix would each copy it again
        and drop others' copies for room, for the few tokens each holds of its own (the H200 run of 64 agents
        after a fanout of one 8k document: 64 copies of ~470 MB each in one admission, 2.6 s); what they share
        stays in the slot or copy that holds it, and the rest is recomputed."""
        tokens = self._tokens.view(slot)
        if self.host is None or not self.host.worth_keeping(len(tokens)):
            return False
        half = tokens[:(len(tokens) + 1) // 2]  # a prefix this long held elsewhere: no copy
        shared = self._tokens.common_prefixes(half)
        if any(other != slot and self.state[other] != "free" and shared[other] == len(half)
               for other in range(self.n_slots)):
            return False
        _, copied = self.host_prefix(tokens)
        return copied < len(half) or self.host.holds(tokens, cold=self._cold[slot], owner=self._owner[slot])

    def _copy_to_host(self, slot: int, *, make_room: bool = True) -> bool:
        assert self.host is not None
        if slot in self._unsettled:  # its device data is not what the mirror says until the next decode
            return False
        try:
            return self.host.keep(self.tokens(slot), self.ctx.seq_state_size(slot),
                                  lambda view: self.ctx.seq_state_get(slot, view), cold=self._cold[slot],
                                  owner=self._owner[slot], released_at=self._released_at[slot],
                                  make_room=make_room)
        except KvrtError as exc:  # e.g. a sliding-window cache that no longer holds the whole prefix
            log.debug("slot %d not copied to the host tier: %s", slot, exc)
            return False

    def describe(self) -> list[str]:
        """Each slot's state in a word (``pinned`` for pinned cached slots)."""
        return ["pinned" if s in self.pinned else self.state[s] for s in range(self.n_slots)]
