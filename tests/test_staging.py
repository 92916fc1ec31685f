"""The prefetching KV stager: staged, swapped and restored agents continue exactly like agents that never left.

The reference for every agent is the same agent decoded greedily in a context of its own
that it never leaves. The stager's paths (a free context, a new one charged to the
ledger, one taken over behind its drain, a source still being captured) must give the
same tokens; its refusals must change nothing; cancel and close must leak nothing.
Nothing here is timed.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvrt.accounting.ledger import VramLedger
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.errors import InvalidArgument, KvrtError
from kvrt.state.hostpool import HostBuffer, HostPool, HostPoolError
from kvrt.state.snapshot import Snapshot, SnapshotMismatch
from kvrt.state.staging import (
    KVStager,
    PendingSnapshot,
    PrefetchCancelled,
    StagingError,
    StagingFull,
)

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. "
TINY = ContextParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, flash_attn="off")
GB = 1 << 30


def greedy(ctx: Context, pending: int, n: int) -> list[int]:
    """Decode ``pending`` and ``n - 1`` greedy successors into sequence 0; returns the ``n`` tokens picked."""
    out = []
    with Batch(1) as batch:
        for _ in range(n):
            batch.clear()
            batch.add(pending, ctx.seq_len(0), 0, logits=True)
            ctx.decode(batch)
            pending = int(np.argmax(ctx.logits(0)))
            out.append(pending)
    return out


def history(model: Model, words: int) -> list[int]:
    """The first ``words`` words of a repeated sentence, tokenized."""
    return model.tokenize(" ".join((TEXT * 8).split()[:words]))


def captured(model: Model, params: ContextParams, tokens: list[int]) -> Snapshot:
    """A host snapshot of ``tokens[:-1]`` (the last token is the agent's pending input)."""
    with Context(model, params) as ctx:
        prefill(ctx, tokens[:-1], logits_last=False)
        return Snapshot.capture(ctx, 0, pool=HostPool(pinned=False), tokens=tokens[:-1])


class Resident:
    """The reference: an agent decoded turn after turn in a context it never leaves."""

    def __init__(self, model: Model, params: ContextParams, tokens: list[int]) -> None:
        self.ctx = Context(model, params)
        prefill(self.ctx, tokens[:-1], logits_last=False)
        self.pending = tokens[-1]

    def turn(self, n: int) -> list[int]:
        out = greedy(self.ctx, self.pending, n)
        self.pending = out[-1]
        return out


def serve_round_robin(stager: KVStager, snapshots: list[Snapshot], pendings: list[int], turns: int,
                      per_turn: int) -> list[list[int]]:
    """Round robin through the agents, the next one prefetched while the current one decodes (as a scheduler
    would); each agent swapped out after its turn. Returns every agent's tokens, turn after turn."""
    sources: list[Snapshot | PendingSnapshot] = list(snapshots)
    order = [i for _ in range(turns) for i in range(len(snapshots))]
    out: list[list[int]] = [[] for _ in snapshots]
    handle = stager.prefetch(sources[order[0]])
    swapped: list[Snapshot] = []
    records = []
    for step, agent in enumerate(order):
        ctx = stager.activate(handle)
        assert handle.record is not None and handle.record.nbytes > 0
        records.append(handle.record)
        if step + 1 < len(order):
            handle = stager.prefetch(sources[order[step + 1]])
        tokens = greedy(ctx, pendings[agent], per_turn)
        pendings[agent] = tokens[-1]
        out[agent] += tokens
        sources[agent] = stager.swap_out_async(ctx)
    for source in sources:
        if isinstance(source, PendingSnapshot):
            swapped.append(source.result())
    for snap in swapped:
        snap.release()
    stats = stager.stats  # the totals are the sums of what each activation reported
    assert stats.bytes_in == sum(r.nbytes for r in records)
    assert stats.exposed_ms == pytest.approx(sum(r.exposed_ms for r in records))
    assert stats.restore_ms == pytest.approx(sum(r.restore_ms for r in records))
    assert all(r.restore_ms <= r.stage_ms for r in records)
    assert 0.0 <= stats.hidden_fraction <= 1.0
    return out


def run_agents(model: Model, params: ContextParams, lengths: list[int], *, turns: int, per_turn: int,
               max_contexts: int) -> tuple[list[list[int]], list[list[int]], KVStager]:
    """(stager tokens, resident reference tokens, the closed stager) for agents of ``lengths`` words."""
    histories = [history(model, n) for n in lengths]
    snapshots = [captured(model, params, h) for h in histories]
    residents = [Resident(model, params, h) for h in histories]
    try:
        expected = [[t for _ in range(turns) for t in r.turn(per_turn)] for r in residents]
    finally:
        for r in residents:
            r.ctx.close()
    ledger = VramLedger(capacity_bytes=64 * GB)
    with KVStager(model, params, ledger, max_contexts=max_contexts) as stager:
        got = serve_round_robin(stager, snapshots, [h[-1] for h in histories], turns, per_turn)
    for snap in snapshots:
        snap.release()
    assert ledger.allocated_bytes == 0
    return got, expected, stager


@pytest.mark.parametrize(("n_agents", "max_contexts"), [(3, 2), (2, 2), (4, 3)])
def test_prefetched_agents_continue_token_identically(tiny_model, n_agents, max_contexts):
    lengths = [12, 30, 21, 40][:n_agents]
    got, expected, stager = run_agents(tiny_model, TINY, lengths, turns=4, per_turn=3, max_contexts=max_contexts)
    assert got == expected
    stats = stager.stats
    assert stats.activations == stats.swap_outs == 4 * n_agents
    assert stats.contexts == max_contexts
    assert stats.failed == stats.cancelled == 0
    assert stats.bytes_in > 0 and stats.bytes_out > stats.bytes_in * 0.5  # states grow by one turn each time


def test_demo_model_agents_continue_token_identically(demo_model):
    params = ContextParams(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=1, flash_attn="off")
    got, expected, _ = run_agents(demo_model, params, [25, 60, 40], turns=2, per_turn=3, max_contexts=2)
    assert got == expected
    assert len({tuple(t) for t in expected}) == 3  # three different continuations, so a mix-up would show


@pytest.fixture
def agent(tiny_model):
    tokens = history(tiny_model, 20)
    snap = captured(tiny_model, TINY, tokens)
    yield snap, tokens
    snap.release()


def reference_after(model: Model, tokens: list[int], n: int) -> list[int]:
    resident = Resident(model, TINY, tokens)
    try:
        return resident.turn(n)
    finally:
        resident.ctx.close()


def test_ledger_denial_is_a_clear_error_and_changes_nothing(tiny_model, agent):
    snap, tokens = agent
    one = 10 << 20
    ledger = VramLedger(capacity_bytes=one + one // 2)  # room for one staging context
    with KVStager(tiny_model, TINY, ledger, max_contexts=4, context_bytes=one) as stager:
        first = stager.prefetch(snap)
        with pytest.raises(StagingFull, match="ledger refused") as err:
            stager.prefetch(snap)
        assert err.value.denied is not None and err.value.max_contexts == 4
        assert sum(err.value.busy.values()) == 1
        assert ledger.allocated_bytes == one and stager.stats.prefetches == 1
        ctx = stager.activate(first)  # the refused call left the first prefetch intact
        assert greedy(ctx, tokens[-1], 4) == reference_after(tiny_model, tokens, 4)
        stager.swap_out_async(ctx).result().release()
        stager.activate(stager.prefetch(snap))  # the context is free again
    assert ledger.allocated_bytes == 0


def test_the_bound_on_staging_contexts_is_kept(tiny_model, agent):
    snap, _ = agent
    with KVStager(tiny_model, TINY, VramLedger(capacity_bytes=64 * GB), max_contexts=1) as stager:
        stager.activate(stager.prefetch(snap))
        with pytest.raises(StagingFull, match="maximum of 1") as err:
            stager.prefetch(snap)
        assert err.value.busy == {"active": 1} and err.value.denied is None


def test_a_snapshot_of_another_model_is_refused_before_anything_is_staged(tiny_model, other_tiny_model_path):
    other = Model(other_tiny_model_path)
    try:
        foreign = captured(other, TINY, history(other, 10))
    finally:
        other.close()
    ledger = VramLedger(capacity_bytes=64 * GB)
    with KVStager(tiny_model, TINY, ledger) as stager, foreign:
        with pytest.raises(SnapshotMismatch, match="cannot be staged"):
            stager.prefetch(foreign)
        assert stager.stats.prefetches == 0 and stager.stats.contexts == 0 and ledger.allocated_bytes == 0


def test_a_layout_mismatch_surfaces_at_activation_and_frees_the_context(tiny_model, agent):
    snap, tokens = agent
    flash = ContextParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, flash_attn="on")
    with KVStager(tiny_model, flash, VramLedger(capacity_bytes=64 * GB), max_contexts=1) as stager:
        handle = stager.prefetch(snap)
        with pytest.raises(SnapshotMismatch, match="flash_attn"):
            stager.activate(handle)
        assert stager.states() == {"free": 1} and stager.stats.failed == 1
        with Context(tiny_model, flash) as ctx:  # the stager still works with a state of its own layout
            prefill(ctx, tokens[:-1], logits_last=False)
            with Snapshot.capture(ctx, 0) as own:
                restored = stager.activate(stager.prefetch(own))
                assert greedy(restored, tokens[-1], 3) == greedy(ctx, tokens[-1], 3)


def test_bad_calls_are_refused_with_what_was_wrong(tiny_model, agent):
    snap, _ = agent
    ledger = VramLedger(capacity_bytes=64 * GB)
    with pytest.raises(InvalidArgument, match="n_seq_max must be 1"):
        KVStager(tiny_model, ContextParams(n_ctx=256, n_seq_max=2), ledger)
    with KVStager(tiny_model, TINY, ledger) as stager, KVStager(tiny_model, TINY, ledger, name="other") as other:
        with pytest.raises(InvalidArgument, match="Snapshot or a PendingSnapshot"):
            stager.prefetch("agent-7")  # type: ignore[arg-type]
        handle = stager.prefetch(snap)
        with pytest.raises(StagingError, match="not a prefetch of this stager"):
            other.activate(handle)
        ctx = stager.activate(handle)
        with pytest.raises(StagingError, match="already activated"):
            stager.activate(handle)
        with pytest.raises(StagingError, match="not a context this stager activated"):
            other.swap_out_async(ctx)
        with Context(tiny_model, TINY) as foreign, pytest.raises(StagingError, match="not a context this stager"):
            stager.swap_out_async(foreign)
        pending = stager.swap_out_async(ctx)
        with pytest.raises(StagingError, match="already swapped out"):
            stager.swap_out_async(ctx)
        pending.result().release()
        released = captured(tiny_model, TINY, history(tiny_model, 5))
        released.release()
        with pytest.raises(StagingError, match="released snapshot"):
            stager.prefetch(released)


class GatedPool(HostPool):
    """A host pool whose next lease waits for :attr:`gate` (or fails once when :attr:`fail` is set)."""

    def __init__(self) -> None:
        super().__init__(pinned=False)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()
        self.fail = False

    def acquire(self, nbytes: int) -> HostBuffer:
        self.waiting.set()
        self.gate.wait()
        if self.fail:
            self.fail = False
            raise HostPoolError("refused on purpose")
        return super().acquire(nbytes)


@contextmanager
def blocked_swap_out(stager: KVStager, pool: GatedPool, snap: Snapshot) -> Iterator[PendingSnapshot]:
    """An agent activated and swapped out, its capture held at the pool until the block ends."""
    ctx = stager.activate(stager.prefetch(snap))
    pool.gate.clear()
    pool.waiting.clear()
    pending = stager.swap_out_async(ctx)
    assert pool.waiting.wait(10)
    try:
        yield pending
    finally:
        pool.gate.set()


def test_cancel_a_ready_prefetch_frees_its_context(tiny_model, agent):
    snap, tokens = agent
    with KVStager(tiny_model, TINY, VramLedger(capacity_bytes=64 * GB), max_contexts=1) as stager:
        handle = stager.prefetch(snap)
        handle._future.result()  # type: ignore[union-attr]  # wait until it is staged
        assert handle.ready() and handle.cancel()
        assert stager.states() == {"free": 1}
        with pytest.raises(PrefetchCancelled):
            stager.activate(handle)
        ctx = stager.activate(stager.prefetch(snap))  # the one context serves the next agent, emptied
        assert ctx.seq_len(0) == snap.n_tokens
        assert greedy(ctx, tokens[-1], 3) == reference_after(tiny_model, tokens, 3)
        assert stager.stats.cancelled == 1


def test_cancel_a_prefetch_whose_copy_is_running(tiny_model, agent):
    snap, tokens = agent
    pool = GatedPool()
    with KVStager(tiny_model, TINY, VramLedger(capacity_bytes=64 * GB), max_contexts=2, host_pool=pool) as stager:
        with blocked_swap_out(stager, pool, snap) as pending:
            handle = stager.prefetch(pending)  # its copy waits on the capture
            assert not handle.ready() and handle.cancel()
        swapped = pending.result()
        with pytest.raises(PrefetchCancelled):
            stager.activate(handle)
        stager._copy_in.submit(lambda: None).result()  # the cancelled copy has finished
        assert stager.states() == {"free": 2}
        with swapped:  # the swapped-out agent was not lost: it continues like the reference
            ctx = stager.activate(stager.prefetch(swapped))
            assert greedy(ctx, tokens[-1], 3) == reference_after(tiny_model, tokens, 3)


def test_a_failed_swap_out_leaves_the_agent_active(tiny_model, agent):
    snap, tokens = agent
    pool = GatedPool()
    with KVStager(tiny_model, TINY, VramLedger(capacity_bytes=64 * GB), max_contexts=1, host_pool=pool) as stager:
        ctx = stager.activate(stager.prefetch(snap))
        first = greedy(ctx, tokens[-1], 2)
        pool.fail = True
        pending = stager.swap_out_async(ctx)
        with pytest.raises(StagingError, match="stays active.*refused on purpose"):
            pending.result()
        assert stager.states() == {"active": 1}
        rest = greedy(ctx, first[-1], 2)  # still the caller's, holding the agent
        assert first + rest == reference_after(tiny_model, tokens, 4)
        stager.swap_out_async(ctx).result().release()


def test_a_prefetch_behind_a_failed_drain_fails_and_the_agent_stays(tiny_model, agent):
    snap, _ = agent
    pool = GatedPool()
    with KVStager(tiny_model, TINY, VramLedger(capacity_bytes=64 * GB), max_contexts=1, host_pool=pool) as stager:
        with blocked_swap_out(stager, pool, snap) as pending:
            queued = stager.prefetch(snap)  # only the draining context is left: it waits behind the drain
            pool.fail = True
        with pytest.raises(StagingError, match="could not be drained"):
            stager.activate(queued)
        with pytest.raises(StagingError):
            pending.result()
        assert stager.states() == {"active": 1}


def test_close_while_a_prefetch_runs_loses_no_agent_and_leaks_nothing(tiny_model, agent):
    snap, tokens = agent
    pool = GatedPool()
    ledger = VramLedger(capacity_bytes=64 * GB)
    stager = KVStager(tiny_model, TINY, ledger, max_contexts=3, host_pool=pool)
    ready = stager.prefetch(snap)
    with blocked_swap_out(stager, pool, snap) as pending:
        running = stager.prefetch(pending)
        closing = threading.Thread(target=stager.close)
        closing.start()
    closing.join(30)
    assert not closing.is_alive() and stager.closed
    assert ledger.allocated_bytes == 0
    for handle in (ready, running):
        with pytest.raises((PrefetchCancelled, StagingError)):
            stager.activate(handle)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvrt-stager")]
    with pending.result() as swapped, Context(tiny_model, TINY) as ctx:  # captured before the close ended: kept
        swapped.restore(ctx, 0)
        assert greedy(ctx, tokens[-1], 3) == reference_after(tiny_model, tokens, 3)
    gc.collect()
    assert pool.stats.bytes_in_use == 0
    with pytest.raises(StagingError, match="closed"):
        stager.prefetch(snap)
    stager.close()  # twice is harmless


def test_many_cycles_leak_no_host_memory_and_no_ledger_bytes(tiny_model, agent):
    snap, tokens = agent
    pool = HostPool(pinned=False, max_bytes=8 * (1 << 20))
    ledger = VramLedger(capacity_bytes=64 * GB)
    with KVStager(tiny_model, TINY, ledger, max_contexts=2, host_pool=pool) as stager:
        for i in range(40):
            handle = stager.prefetch(snap)
            if i % 3 == 0:
                handle.cancel()
                continue
            ctx = stager.activate(handle)
            greedy(ctx, tokens[-1], 1)
            stager.swap_out_async(ctx)  # dropped unread: its snapshot goes back to the pool when collected
        gc.collect()
        stager._copy_out.submit(lambda: None).result()
        gc.collect()
        assert pool.stats.bytes_in_use == 0
        assert stager.stats.contexts <= 2
    assert ledger.allocated_bytes == 0


def test_a_cancelled_prefetch_queued_behind_a_drain_keeps_no_part_of_that_capture(tiny_model, agent):
    """A prefetch that waited for a slot's swap-out and was then cancelled holds its error (and the frame it was
    raised in) as long as its handle lives; that must not keep the swapped-out agent's snapshot and host buffer.
    (Seen on the H200 as host memory still in use after many cycles; reproduced here by making the drain wait.)"""
    snap, tokens = agent
    pool = HostPool(pinned=False, max_bytes=8 * (1 << 20))
    with KVStager(tiny_model, TINY, VramLedger(capacity_bytes=64 * GB), max_contexts=1, host_pool=pool) as stager:
        ctx = stager.activate(stager.prefetch(snap))
        greedy(ctx, tokens[-1], 1)
        gate = threading.Event()
        stager._copy_out.submit(gate.wait)  # the swap-out waits in line, so the prefetch queues behind its drain
        pending = stager.swap_out_async(ctx)
        handle = stager.prefetch(snap)
        assert handle.cancel()
        gate.set()
        assert pending.result().n_tokens == snap.n_tokens + 1
        del pending  # the caller drops the capture
        handle.settle()
        gc.collect()
        assert pool.stats.bytes_in_use == 0
        assert handle.cancelled  # the handle itself is still here


def test_prefetch_bench_serves_every_arm_the_same_tokens(tiny_model_path, tmp_path):
    """`kvrt bench prefetch` on the tiny model: all arms agree token for token; every figure and bound is written
    (the bounds themselves are not judged on a shared CPU's timings)."""
    import argparse
    import json

    from kvrt_bench import prefetch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    prefetch.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--model", str(tiny_model_path), "--agents", "12",
                              "--tokens", "40-90", "--decode-tokens", "2", "--rounds", "3", "--threads", "1",
                              "--staging-contexts", "2", "--flash-attn", "off,on"])
    assert prefetch.run(args) in (0, 3)
    result = json.loads((tmp_path / "prefetch.json").read_text())
    assert [m["flash_attn"] for m in result["modes"]] == ["off", "on"]
    for mode in result["modes"]:
        assert mode["tokens_identical_to_resident"] == {"sync": True, "prefetch": True}
        assert mode["stager"]["activations"] == mode["stager"]["swap_outs"] == 12 * 3
        assert mode["stager"]["contexts"] == 2 and mode["stager"]["failed"] == 0
        assert set(mode["goals"]) <= set(mode["figures"])
    assert json.loads((tmp_path / "bounds.json").read_text())["bounds"]
    rows = (tmp_path / "activations.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 * 12 * 3  # two modes x two swapping arms x agents x rounds


def test_prefetch_bench_refuses_agents_that_would_all_fit(tiny_model_path, tmp_path):
    import argparse

    from kvrt_bench import prefetch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    prefetch.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--model", str(tiny_model_path), "--agents", "2",
                              "--tokens", "20-30", "--staging-contexts", "4", "--threads", "1"])
    with pytest.raises(KvrtError, match="fit in the 4 staging contexts"):
        prefetch.run(args)
    with pytest.raises(KvrtError, match="LO-HI"):
        prefetch.token_range("8k-32k")
    args.staging_contexts = 1
    with pytest.raises(KvrtError, match="staging-contexts must be at least 2"):
        prefetch.run(args)


def test_warm_creates_charged_contexts_up_to_what_the_ledger_admits(tiny_model, agent):
    from kvrt.accounting.ledger import LedgerDenied

    snap, _ = agent
    one = 10 << 20
    ledger = VramLedger(capacity_bytes=one + one // 2)
    with KVStager(tiny_model, TINY, ledger, max_contexts=3, context_bytes=one) as stager:
        with pytest.raises(LedgerDenied):
            stager.warm(2)
        assert stager.stats.contexts == 1 and ledger.allocated_bytes == one and stager.states() == {"free": 1}
        handle = stager.prefetch(snap)
        stager.activate(handle)
        assert handle.record is not None and not handle.record.created_context  # the warmed context was used
    with KVStager(tiny_model, TINY, VramLedger(capacity_bytes=64 * GB)) as cold:
        handle = cold.prefetch(snap)
        cold.activate(handle)
        assert handle.record is not None and handle.record.created_context
    assert ledger.allocated_bytes == 0


def test_an_adopted_context_drains_into_a_prefetch_and_leaves_detached_with_its_charge(tiny_model, agent):
    """adopt -> swap_out_async -> prefetch behind the drain -> detach: the agents continue like residents,
    every charge is where it should be, trim gives idle contexts back, and refusals change nothing."""
    snap, tokens = agent
    other_tokens = history(tiny_model, 30)
    ledger = VramLedger(capacity_bytes=64 * GB)
    one = 10 << 20
    with KVStager(tiny_model, TINY, ledger, max_contexts=1, context_bytes=one) as stager:
        live = Context(tiny_model, TINY)
        prefill(live, other_tokens[:-1], logits_last=False)
        charge = ledger.try_reserve(one, "agent:x")
        with Context(tiny_model, ContextParams(n_ctx=512, n_threads=1)) as wrong, \
                pytest.raises(StagingError, match="n_ctx=256"):
            stager.adopt(wrong, charge)
        stager.adopt(live, charge)
        assert ledger.snapshot().by_owner == {"staging:stager#0": one} and stager.held_bytes == one
        refused = ledger.try_reserve(one, "agent:y")
        with pytest.raises(StagingFull):  # at the bound: the charge stays the caller's
            stager.adopt(live, refused)
        assert ledger.snapshot().by_owner["agent:y"] == one
        ledger.release(refused)
        pending = stager.swap_out_async(live, tokens=other_tokens[:-1])
        handle = stager.prefetch(snap)  # queued behind the drain of the adopted context
        moved = pending.result()
        ctx = stager.activate(handle)
        assert ctx is live  # the adopted context, emptied and restored into
        ctx, reservation = stager.detach(ctx)
        assert reservation is charge and stager.held_bytes == 0 and stager.states() == {}
        ledger.transfer(reservation, "agent:x")
        assert greedy(ctx, tokens[-1], 4) == reference_after(tiny_model, tokens, 4)
        with pytest.raises(StagingError, match="not a context this stager activated"):
            stager.detach(ctx)
        ctx.close()
        ledger.release(reservation)
        second = stager.activate(stager.prefetch(moved))  # a new staging context, charged anew
        assert greedy(second, other_tokens[-1], 4) == reference_after(tiny_model, other_tokens, 4)
        stager.swap_out_async(second).result().release()
        assert stager.states() == {"free": 1} and stager.trim() == one and stager.held_bytes == 0
        moved.release()
    assert ledger.allocated_bytes == 0
