"""Scheduler and registry on real llama.cpp (CPU, tiny model): swap exactness, fairness, admission, rollback."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvrt.accounting.estimate import DeviceMeter, EstimateError, ModelShape, context_estimate, parse_vram_table
from kvrt.accounting.ledger import LedgerDenied, VramLedger
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.model import Model
from kvrt.errors import ModelLoadError
from kvrt.serve.registry import ModelRegistry, RegistryError
from kvrt.serve.results import AgentExists, UnknownAgent
from kvrt.serve.scheduler import Scheduler

N_CTX = 256
PROMPTS = ["The fox", " jumps over", " the lazy dog"]


def budget(path: Path, models: int, contexts: int) -> int:
    """Room for ``models`` copies of the weights and exactly ``contexts`` live contexts of ``N_CTX`` cells.

    Exact where the ledger charges the header's estimates: on a CPU machine (the weights are charged
    llama.cpp's count of them, the file's tensor bytes), or on a GPU under :func:`charge_estimates`
    (the weights left on the host, the token embedding, are then uncharged: less than one context of slack).
    """
    shape = ModelShape.read(path)
    return models * shape.weight_bytes(on_gpu=False) + contexts * context_estimate(shape, N_CTX).total_bytes


def charge_estimates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the device measurement off, so the ledger charges what :func:`budget` counts on every machine.

    Where llama.cpp has a GPU, the registry resizes a model's reservation and the residency each new
    context's charge to the drop in the device's free memory (:class:`DeviceMeter`): whole 2 MiB pages,
    the CUDA runtime's first allocations included. For the tiny model that is a different number of bytes
    than the header's, so ``budget(path, 1, 2)`` admits one live context or three instead of two. Without
    a measurement (``delta() is None``) the registry keeps the header's estimate of the weights on the
    device and the residency each context's estimate.
    """
    monkeypatch.setattr(DeviceMeter, "delta", lambda self: None)


@pytest.fixture(autouse=True)
def _estimated_charges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here sizes its ledger with :func:`budget` or compares charges to estimates."""
    charge_estimates(monkeypatch)


def never_left(path: Path, prompts: list[str], n: int) -> list[list[int]]:
    """Reference: the same turns in one context that is never swapped (plain kvrt.generate, each turn
    feeding the token the previous one sampled last before its prompt)."""
    out: list[list[int]] = []
    with Model(path) as model, Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=1) as ctx:
        unfed: list[int] = []
        for i, prompt in enumerate(prompts):
            done = generate(ctx, unfed + model.tokenize(prompt, add_special=i == 0), GenerationParams(max_tokens=n))
            out.append(done.tokens)
            unfed = done.sampled[-1:]
    return out


def test_swapped_out_and_back_in_generates_the_same_greedy_tokens(tiny_model_path, other_tiny_model_path):
    ledger = VramLedger(budget(tiny_model_path, 2, 1))  # one live context: every switch swaps
    with Scheduler(ledger, n_threads=1) as sched:
        sched.register("a", tiny_model_path, N_CTX)
        sched.register("b", other_tiny_model_path, N_CTX)
        got, restored = [], []
        for prompt in PROMPTS:
            result = sched.decode("a", prompt, 8)
            got.append(result.tokens)
            restored.append(result.restored)
            other = sched.decode("b", prompt, 8)
            assert other.evicted == ("a",)
        assert restored == [False, True, True]
        assert sched.metrics("a").swap_ins == 2
    assert got == never_left(tiny_model_path, PROMPTS, 8)
    assert ledger.allocated_bytes == 0


def test_same_model_agents_hand_over_the_context(tiny_model_path):
    ledger = VramLedger(budget(tiny_model_path, 1, 1))
    with Scheduler(ledger, n_threads=1) as sched:
        sched.register("a", tiny_model_path, N_CTX)
        sched.register("b", tiny_model_path, N_CTX)
        first = sched.decode("a", PROMPTS[0], 6)
        switch = sched.decode("b", PROMPTS[0], 6)
        assert switch.evicted == ("a",) and switch.metrics.context_ms == 0.0  # reused, not re-created
        assert switch.tokens == first.tokens  # same model, same prompt, fresh document
        back = sched.decode("a", PROMPTS[1], 6)
        assert back.restored
        assert ledger.snapshot().by_owner["agent:a"] > 0 and "agent:b" not in ledger.snapshot().by_owner
    assert [first.tokens, back.tokens] == never_left(tiny_model_path, PROMPTS[:2], 6)


def hold_worker(sched: Scheduler) -> tuple[threading.Event, threading.Thread]:
    """Occupy the scheduler's worker until the returned event is set (requests queue meanwhile)."""
    gate, running = threading.Event(), threading.Event()

    def block() -> None:
        running.set()
        gate.wait()

    thread = threading.Thread(target=sched._call, args=(block,))
    thread.start()
    running.wait()
    return gate, thread


def test_fair_share_of_tokens_under_contention(tiny_model_path):
    """An agent queuing many long requests neither starves short ones nor is shut out itself."""
    ledger = VramLedger(budget(tiny_model_path, 1, 3))
    with Scheduler(ledger, n_threads=1) as sched:
        for name in ("hog", "x", "y"):
            sched.register(name, tiny_model_path, 2048)
        gate, holder = hold_worker(sched)
        futures = [sched.submit("hog", "a", 16) for _ in range(8)]
        futures += [sched.submit(n, "b", 4) for _ in range(6) for n in ("x", "y")]
        gate.set()
        holder.join()
        for future in futures:
            future.result()
        order = [m.agent_id for m in sched.history()]
    last = {name: max(i for i, who in enumerate(order) if who == name) for name in ("hog", "x", "y")}
    assert last["x"] < last["hog"] and last["y"] < last["hog"]  # short agents are not stuck behind the hog
    assert "hog" in order[:3] and order.count("hog") == 8  # the hog is served early and completely
    # by tokens, nobody is ahead of another backlogged agent by more than one request's worth
    assert order[:9].count("x") >= 3 and order[:9].count("y") >= 3


def test_register_refusals_change_nothing(tiny_model_path, tmp_path):
    ledger = VramLedger(budget(tiny_model_path, 1, 1))
    with Scheduler(ledger, n_threads=1) as sched:
        sched.register("a", tiny_model_path, N_CTX)
        before = ledger.snapshot()
        with pytest.raises(LedgerDenied) as info:
            sched.register("huge", tiny_model_path, 1 << 16)
        assert info.value.request_bytes == context_estimate(ModelShape.read(tiny_model_path), 1 << 16).total_bytes
        with pytest.raises(AgentExists):
            sched.register("a", tiny_model_path, N_CTX)
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(b"GGUF" + b"\0" * 64)
        with pytest.raises(EstimateError, match="version 0"):
            sched.register("b", broken, N_CTX)
        assert ledger.snapshot() == before
        assert [a.agent_id for a in sched.agents()] == ["a"]
        with pytest.raises(UnknownAgent):
            sched.submit("nobody", "x", 1)


def test_fork_branches_from_the_sources_document(tiny_model_path):
    ledger = VramLedger(budget(tiny_model_path, 1, 1))
    with Scheduler(ledger, n_threads=1) as sched:
        sched.register("a", tiny_model_path, N_CTX)
        sched.decode("a", PROMPTS[0], 5)
        info = sched.fork("a", "b")
        assert info.held_tokens > 0
        branch = sched.decode("b", PROMPTS[1], 6)
        assert branch.restored
        original = sched.decode("a", PROMPTS[1], 6)
        assert branch.tokens == original.tokens  # both continue the same document


def test_unregister_frees_everything_and_fails_queued_requests(tiny_model_path):
    ledger = VramLedger(budget(tiny_model_path, 1, 2))
    sched = Scheduler(ledger, n_threads=1)
    sched.register("a", tiny_model_path, N_CTX)
    sched.decode("a", "hi", 2)
    gate, held = hold_worker(sched)
    queued = sched.submit("a", "later", 2)
    unregistering = threading.Thread(target=sched.unregister, args=("a",))
    unregistering.start()
    while not sched._control:  # the unregister call is queued behind the held worker
        threading.Event().wait(0.001)
    gate.set()
    unregistering.join()
    held.join()
    with pytest.raises(UnknownAgent):
        queued.result()
    assert ledger.allocated_bytes == 0 and sched.registry.models() == []
    sched.close()


def test_registry_shares_by_path_and_rolls_back_failed_loads(tiny_model_path, tmp_path):
    ledger = VramLedger(10**9)
    registry = ModelRegistry(ledger)
    one = registry.acquire(tiny_model_path)
    two = registry.acquire(str(tiny_model_path))
    assert one is two and one.refcount == 2 and len(ledger.snapshot().reservations) == 1
    if registry.on_gpu:  # no device measurement (charge_estimates): the header's estimate stands
        assert one.measured_bytes is None and one.reservation.nbytes == one.estimated_bytes
    else:  # a CPU machine charges llama.cpp's own count, the file's tensor bytes
        assert one.measured_bytes == one.model.size_bytes == ModelShape.read(tiny_model_path).file_weight_bytes
    registry.release(one)
    assert not one.model.closed
    registry.release(two)
    assert one.model.closed and ledger.allocated_bytes == 0
    with pytest.raises(RegistryError):
        registry.release(one)
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny_model_path.read_bytes()[: 1 << 16])
    with pytest.raises((ModelLoadError, EstimateError)):
        registry.acquire(bad)
    assert ledger.allocated_bytes == 0 and registry.models() == []


def test_registry_denies_before_loading(tiny_model_path):
    ledger = VramLedger(1000)
    registry = ModelRegistry(ledger)
    with pytest.raises(LedgerDenied):
        registry.acquire(tiny_model_path)
    assert registry.models() == [] and ledger.allocated_bytes == 0


def test_vram_table_overrides_and_is_parsed_strictly(tiny_model_path):
    table = parse_vram_table(f"# lmxd model_vram\n{tiny_model_path.name}  4000000\n")
    ledger = VramLedger(10**9)
    registry = ModelRegistry(ledger, table=table)
    entry = registry.acquire(tiny_model_path)
    assert entry.estimate_source == "table" and entry.reservation.nbytes == 4_000_000
    registry.release(entry)
    for bad, message in [("a 1 2", "fields"), ("a x", "integer"), ("a 1\na 2", "twice"), (f"a {2**64}", "64")]:
        with pytest.raises(EstimateError, match=message):
            parse_vram_table(bad)


def test_kv_estimate_matches_llama_cpps_state_size(tiny_model, tiny_model_path):
    """The header-derived per-token KV bytes equal what llama.cpp serialises per token."""
    shape = ModelShape.read(tiny_model_path)
    with Context(tiny_model, n_ctx=N_CTX, n_threads=1) as ctx:
        generate(ctx, "x" * 20, GenerationParams(max_tokens=1))
        a, n_a = ctx.seq_state_size(0), ctx.seq_len(0)
        generate(ctx, "y" * 40, GenerationParams(max_tokens=1))
        b, n_b = ctx.seq_state_size(0), ctx.seq_len(0)
    per_token = (b - a) / (n_b - n_a)
    cell_metadata = 12  # position + sequence count + sequence id stored per cell
    assert per_token == shape.kv_bytes_per_token() + cell_metadata


def test_header_reader_agrees_with_the_gguf_package(tiny_model_path, tmp_path):
    import gguf

    shape = ModelShape.read(tiny_model_path)
    reader = gguf.GGUFReader(str(tiny_model_path))
    assert shape.file_weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert shape.n_vocab == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert (shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv) == (4, 128, 4, 2)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_model_path.read_bytes()[:200])
    with pytest.raises(EstimateError, match="truncated"):
        ModelShape.read(cut)
    text = tmp_path / "text.gguf"
    text.write_bytes(b"nope")
    with pytest.raises(EstimateError, match="not a GGUF"):
        ModelShape.read(text)
