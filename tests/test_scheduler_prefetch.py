"""The scheduler's prefetched swap-ins (kvrt.serve.prefetch) on real llama.cpp (CPU, tiny model).

References: each agent's turns in one context that is never swapped (``never_left``) and a
from-scratch prefill of its transcript (``check_greedy``); the same agents with prefetch off.

The ledger caps count contexts (``budget``): every test here charges the header's estimates
(``charge_estimates``), so a cap admits the same number of live contexts on a GPU as on the CPU.
Two tests emulate the GPU's device probe (``emulated_gpu``): one shows the cap then holds, one what
the H200 run saw when the measured charges left room for one live context (every prefetch falls back).
"""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

import pytest

from _reference import check_greedy
from kvrt.accounting import estimate
from kvrt.accounting.estimate import DeviceMeter, ModelShape, context_estimate
from kvrt.accounting.ledger import VramLedger
from kvrt.serve.registry import ModelRegistry
from kvrt.serve.results import SchedulerClosed, UnknownAgent
from kvrt.serve.scheduler import Scheduler
from kvrt.state.snapshot import Snapshot
from kvrt.system.gpu import Device
from test_scheduler import N_CTX, budget, charge_estimates, hold_worker, never_left

AGENTS = {"a": [" The fox", " jumps over", " the dog"], "b": [" Once upon", " a time", " there was"],
          "c": [" In the", " beginning", " of it all"]}
N = 8
PROBE = " and then"
MEASURED_DELTA = DeviceMeter.delta  # the real measurement, for the test that turns it back on
PAGE = 2 << 20  # CUDA's allocation granularity (the H200's VMM granularity too)


@pytest.fixture(autouse=True)
def _estimated_charges(monkeypatch: pytest.MonkeyPatch) -> None:
    charge_estimates(monkeypatch)


@pytest.fixture
def emulated_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp appears to have a CUDA device: the registry charges the weights it would offload, and each
    measured step (a model load, a context creation) takes two whole 2 MiB pages of its free memory, as the
    tiny model's buffers do rounded up to pages (weights 2.5 MiB; a context's KV and compute buffers)."""
    reads = itertools.count()
    total = 1 << 40

    def devices() -> list[Device]:
        return [Device(1, "CUDA0", "emulated GPU", "gpu", total - next(reads) * 2 * PAGE, total)]

    monkeypatch.setattr(estimate, "llama_gpu_devices", devices)
    assert DeviceMeter.gpu_present()


def weights(path: Path) -> int:
    """The header's weight bytes on the device the ledger budgets (all of them on a CPU machine)."""
    return ModelShape.read(path).weight_bytes(on_gpu=DeviceMeter.gpu_present())


def assert_freed_and_exact(ledger: VramLedger, got: dict[str, list[list[int]]], path: Path) -> None:
    """After close: nothing is charged, and every agent's tokens are those of a context never swapped."""
    assert ledger.allocated_bytes == 0
    for name, prompts in AGENTS.items():
        assert got[name] == never_left(path, prompts, N)


def run_rounds(path: Path, prefetch: bool, *, measure: bool = True
               ) -> tuple[dict[str, list[list[int]]], dict[str, list[int]], Scheduler, VramLedger]:
    """Three agents of one model, a ledger for two live contexts, every round queued at once: most turns swap
    an agent in. ``measure``: the registry's (and so the scheduler's) choice of measured charges on a GPU."""
    ledger = VramLedger(budget(path, 1, 2))
    sched = Scheduler(ledger, ModelRegistry(ledger, measure=measure), n_threads=1, prefetch=prefetch)
    for name in AGENTS:
        sched.register(name, path, N_CTX)
    gate, holder = hold_worker(sched)
    futures = {name: [sched.submit(name, prompt, N) for prompt in prompts] for name, prompts in AGENTS.items()}
    gate.set()
    holder.join()
    results = {name: [f.result() for f in fs] for name, fs in futures.items()}
    got = {name: [r.tokens for r in rs] for name, rs in results.items()}
    transcripts = {name: sched.transcript(name) for name in AGENTS}
    if prefetch:  # every early swap-out is reported by the turn it made room for
        evictions = sum(len(r.evicted) for rs in results.values() for r in rs)
        assert evictions >= sched.prefetcher.counts.early_evictions
    return got, transcripts, sched, ledger


def staging_charges(ledger: VramLedger) -> dict[str, int]:
    return {owner: n for owner, n in ledger.snapshot().by_owner.items() if owner.startswith("staging:")}


def live_charges(sched: Scheduler, path: Path) -> int:
    """What the ledger must hold: the weights and each live agent's context, nothing else."""
    return weights(path) + sum(info.context_bytes for info in sched.agents() if info.state == "active")


def test_prefetched_agents_continue_like_unswapped_and_unprefetched_ones(tiny_model_path):
    got, transcripts, sched, ledger = run_rounds(tiny_model_path, prefetch=True)
    try:
        counts = sched.prefetcher.counts
        assert counts.activations >= 3 and counts.early_evictions >= 3  # the staged path was taken, not fallen back
        assert staging_charges(ledger) == {} and ledger.allocated_bytes == live_charges(sched, tiny_model_path)
        for name in AGENTS:  # the state each agent ends with is its transcript's, as a recompute builds it
            check_greedy(tiny_model_path, transcripts[name], PROBE, sched.decode(name, PROBE, N).tokens, name)
    finally:
        sched.close()
    assert ledger.allocated_bytes == 0
    plain, plain_transcripts, off, _ = run_rounds(tiny_model_path, prefetch=False)
    off.close()
    assert got == plain and transcripts == plain_transcripts
    for name, prompts in AGENTS.items():
        assert got[name] == never_left(tiny_model_path, prompts, N)


def staged_during_bs_turn(path: Path, on_first_piece) -> tuple[Scheduler, VramLedger, object, object]:
    """``a`` swapped out and prefetched while ``b`` runs a turn; ``on_first_piece`` runs at b's first text piece."""
    ledger = VramLedger(budget(path, 1, 2))
    sched = Scheduler(ledger, n_threads=1)
    for name in AGENTS:
        sched.register(name, path, N_CTX)
    for name in ("a", "b", "c"):  # c's turn swaps a out: b and c live
        sched.decode(name, AGENTS[name][0], N)
    assert [i.state for i in sched.agents()] == ["swapped", "active", "active"]
    fired = threading.Event()

    def on_text(piece: str) -> None:
        if not fired.is_set():
            fired.set()
            assert sched.agents()[0].state == "swapped" and sched.prefetcher.counts.staged == 1
            on_first_piece(sched)

    gate, holder = hold_worker(sched)
    b_turn = sched.submit("b", AGENTS["b"][1], N, on_text=on_text)
    a_turn = sched.submit("a", AGENTS["a"][1], N)
    gate.set()
    holder.join()
    b_turn.result()
    assert fired.is_set()
    return sched, ledger, a_turn, b_turn


def test_a_prefetched_agent_cancelled_before_it_runs_leaves_no_charge_and_continues_exactly(tiny_model_path):
    sched, ledger, a_turn, _ = staged_during_bs_turn(tiny_model_path, lambda s: s.cancel("a"))
    try:
        assert a_turn.result().finish_reason == "cancelled"
        before = sched.transcript("a")  # a call on the worker: after the turn's settle and the unstaging
        assert staging_charges(ledger) == {} and ledger.allocated_bytes == live_charges(sched, tiny_model_path)
        assert sched.agents()[0].state == "swapped"
        check_greedy(tiny_model_path, before, PROBE, sched.decode("a", PROBE, N).tokens, "a")
    finally:
        sched.close()
    assert ledger.allocated_bytes == 0


def test_a_prefetched_agent_unregistered_before_it_runs_leaves_no_charge(tiny_model_path):
    def unregister_a(sched: Scheduler) -> None:
        threading.Thread(target=sched.unregister, args=("a",)).start()
        while not sched._control:  # queued behind b's turn, so it runs before a's turn
            threading.Event().wait(0.001)

    sched, ledger, a_turn, _ = staged_during_bs_turn(tiny_model_path, unregister_a)
    try:
        with pytest.raises(UnknownAgent):
            a_turn.result()
        sched.transcript("b")  # a call on the worker: after the unregistering has finished
        assert [i.agent_id for i in sched.agents()] == ["b", "c"]
        owners = ledger.snapshot().by_owner
        assert "agent:a" not in owners and staging_charges(ledger) == {}
        assert ledger.allocated_bytes == live_charges(sched, tiny_model_path)
    finally:
        sched.close()
    assert ledger.allocated_bytes == 0


def test_a_failed_staging_copy_falls_back_to_the_synchronous_restore(tiny_model_path, monkeypatch):
    restore = Snapshot.restore

    def restore_on_the_worker_only(self, ctx, seq_id=0):
        if threading.current_thread().name.startswith("kvrt-") and "-in" in threading.current_thread().name:
            raise OSError("injected: the copy-in thread cannot restore")
        return restore(self, ctx, seq_id)

    monkeypatch.setattr(Snapshot, "restore", restore_on_the_worker_only)
    got, transcripts, sched, ledger = run_rounds(tiny_model_path, prefetch=True)
    try:
        counts = sched.prefetcher.counts
        assert counts.staged >= 3 and counts.activations == 0 and counts.fallbacks >= counts.staged
        assert staging_charges(ledger) == {} and ledger.allocated_bytes == live_charges(sched, tiny_model_path)
    finally:
        sched.close()
    assert_freed_and_exact(ledger, got, tiny_model_path)


def test_no_room_for_a_staging_context_falls_back(tiny_model_path, other_tiny_model_path):
    """One live context, agents of two models: no staging context fits and no live agent has the shape."""
    ledger = VramLedger(budget(tiny_model_path, 2, 1))
    with Scheduler(ledger, n_threads=1) as sched:
        sched.register("a", tiny_model_path, N_CTX)
        sched.register("b", other_tiny_model_path, N_CTX)
        sched.decode("a", AGENTS["a"][0], N)
        sched.decode("b", AGENTS["b"][0], N)
        gate, holder = hold_worker(sched)
        turns = [sched.submit("b", AGENTS["b"][1], N), sched.submit("a", AGENTS["a"][1], N)]
        gate.set()
        holder.join()
        got = [t.result().tokens for t in turns]
        assert sched.prefetcher.counts.fallbacks >= 1 and sched.prefetcher.counts.activations == 0
    assert got[1] == never_left(tiny_model_path, AGENTS["a"][:2], N)[1]
    assert ledger.allocated_bytes == 0


def test_kvrt_serve_turns_prefetch_off_with_a_flag():
    import argparse

    from kvrt.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert parser.parse_args(["--socket", "s"]).prefetch is True
    assert parser.parse_args(["--socket", "s", "--no-prefetch"]).prefetch is False


def test_closing_while_an_agent_is_staged_frees_everything(tiny_model_path):
    closer: list[threading.Thread] = []

    def close_now(sched: Scheduler) -> None:
        closer.append(threading.Thread(target=sched.close))
        closer[0].start()
        while not sched._closing:
            threading.Event().wait(0.001)

    _, ledger, a_turn, b_turn = staged_during_bs_turn(tiny_model_path, close_now)
    closer[0].join()
    with pytest.raises(SchedulerClosed):
        a_turn.result()
    assert len(b_turn.result().tokens) == N  # the running turn finished
    assert ledger.allocated_bytes == 0


def test_on_an_emulated_gpu_the_ledger_admits_two_contexts_and_agents_are_prefetched(tiny_model_path, emulated_gpu):
    """The H200 failure, emulated: with the measured charges (whole pages) the cap of weights + 2 contexts held
    one live context, so nothing was staged; charged by the estimates, the prefetch runs as on the CPU."""
    got, _, sched, ledger = run_rounds(tiny_model_path, prefetch=True)
    try:
        assert sched.registry.on_gpu
        counts = sched.prefetcher.counts
        assert counts.fallbacks == 0 and counts.activations >= 3 and counts.early_evictions >= 3, counts
        assert staging_charges(ledger) == {} and ledger.allocated_bytes == live_charges(sched, tiny_model_path)
    finally:
        sched.close()
    assert_freed_and_exact(ledger, got, tiny_model_path)


def test_with_measuring_off_an_emulated_gpu_charges_the_estimates(tiny_model_path, emulated_gpu, monkeypatch):
    """``ModelRegistry(measure=False)`` (``kvrt serve --charge estimated``): the device is measurable, yet the
    weights and every context keep their header estimates, so the same cap admits two live contexts."""
    monkeypatch.setattr(DeviceMeter, "delta", MEASURED_DELTA)
    got, _, sched, ledger = run_rounds(tiny_model_path, prefetch=True, measure=False)
    try:
        entry, = sched.registry.models()
        assert entry.measured_bytes is None and entry.reservation.nbytes == entry.estimated_bytes == weights(
            tiny_model_path)
        assert sched.prefetcher.counts.fallbacks == 0 and sched.prefetcher.counts.activations >= 3
        assert ledger.allocated_bytes == live_charges(sched, tiny_model_path)
        estimate = context_estimate(ModelShape.read(tiny_model_path), N_CTX).total_bytes
        assert all(i.context_bytes == estimate for i in sched.agents() if i.state == "active")
    finally:
        sched.close()
    assert_freed_and_exact(ledger, got, tiny_model_path)


def test_measured_charges_leaving_one_live_context_make_every_prefetch_fall_back(tiny_model_path, emulated_gpu,
                                                                                monkeypatch, caplog):
    """What the H200 run did, as it should under that ledger: the weights measured at two pages leave room for
    one context, the running agent's, so no staging context fits and no live agent can drain for one; every
    turn restores synchronously and the agents continue exactly."""
    monkeypatch.setattr(DeviceMeter, "delta", MEASURED_DELTA)
    caplog.set_level(logging.DEBUG, logger="kvrt.serve.prefetch")
    got, _, sched, ledger = run_rounds(tiny_model_path, prefetch=True)
    try:
        entry, = sched.registry.models()
        assert entry.reservation.nbytes == 2 * PAGE  # the measurement replaced the header's estimate
        counts = sched.prefetcher.counts
        assert counts.staged == counts.activations == counts.early_evictions == 0 and counts.fallbacks >= 3, counts
        reasons = [r.getMessage() for r in caplog.records if r.name == "kvrt.serve.prefetch"]
        assert len(reasons) == counts.fallbacks
        assert all("no room for a staging context" in r and "no live agent of that shape" in r for r in reasons)
        owners = ledger.snapshot().by_owner
        active = [i.agent_id for i in sched.agents() if i.state == "active"]
        assert len(active) == 1 and set(owners) == {f"model:{tiny_model_path.name}", f"agent:{active[0]}"}
        live_info, = (i for i in sched.agents() if i.state == "active")  # a handed-over context reports its charge
        assert live_info.context_bytes == owners[f"agent:{active[0]}"]
    finally:
        sched.close()
    assert_freed_and_exact(ledger, got, tiny_model_path)
