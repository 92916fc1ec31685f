"""What an agent does at its context limit: refuse (nothing changes), shift (drop after a kept prefix), grow."""

from __future__ import annotations

import pytest

from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.accounting.ledger import LedgerDenied, VramLedger
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.model import Model
from kvrt.errors import InvalidArgument
from kvrt.serve.results import ContextFull
from kvrt.serve.scheduler import Scheduler
from test_scheduler import charge_estimates

TURN = " the quick brown fox jumps over the lazy dog and"


@pytest.fixture(autouse=True)
def _estimated_charges(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledgers here are sized from the header's estimates, so they must charge those on a GPU too."""
    charge_estimates(monkeypatch)


def test_refuse_names_the_numbers_and_changes_nothing(tiny_model_path):
    ledger = VramLedger(1 << 30)
    with Scheduler(ledger, n_threads=1) as sched:
        sched.register("a", tiny_model_path, 256)
        sched.decode("a", TURN, 100)
        before, books = sched.transcript("a"), ledger.snapshot()
        with pytest.raises(ContextFull, match=r"holds \d+ tokens; \+ prompt \(\d+\) \+ max_tokens \(150\) = \d+ "
                                              r"exceeds its n_ctx 256 \(policy=refuse"):
            sched.decode("a", TURN, 150)
        assert sched.transcript("a") == before and ledger.snapshot() == books
        assert sched.decode("a", TURN, 4).tokens  # still serves what fits


def test_policy_arguments_are_checked():
    for kwargs, message in [({"policy": "evict"}, "one of refuse, shift, grow"),
                            ({"policy": "shift", "min_ctx": 256}, "min_ctx applies to policy=grow"),
                            ({"policy": "grow", "min_ctx": 9000}, "exceeds n_ctx"),
                            ({"policy": "shift", "keep": 4096}, "keep must be")]:
        with Scheduler(VramLedger(1 << 30)) as sched, pytest.raises(InvalidArgument, match=message):
            sched.register("a", "/nonexistent.gguf", 4096, **kwargs)


def test_shift_keeps_the_prefix_drops_the_oldest_and_matches_llama_cpp_shifting_by_hand(tiny_model_path):
    """A shifted cache is not a recompute of the kept tokens (their KV was computed with the dropped
    ones in view), so the reference is a plain llama.cpp context doing the same seq_rm + seq_add."""
    results, transcripts = [], []
    with Scheduler(VramLedger(1 << 30), n_threads=1, flash_attn="off") as sched:
        sched.register("s", tiny_model_path, 256, policy="shift", keep=8)
        for _ in range(12):  # ~50 tokens a turn: several shifts
            results.append(sched.decode("s", TURN, 40))
            transcripts.append(sched.transcript("s"))
            assert len(transcripts[-1]) <= 256
            assert transcripts[-1][:8] == transcripts[0][:8]  # the kept prefix never goes
    assert sum(r.metrics.shifted_tokens > 0 for r in results) >= 3
    with Model(tiny_model_path) as model, Context(model, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=1,
                                                   flash_attn="off") as ctx:
        unfed: list[int] = []
        for i, result in enumerate(results):
            drop = result.metrics.shifted_tokens
            if drop:
                ctx.seq_rm(0, 8, 8 + drop)
                ctx.seq_add(0, 8 + drop, -1, -drop)
            done = generate(ctx, unfed + model.tokenize(TURN, add_special=i == 0), GenerationParams(max_tokens=40))
            assert done.tokens == result.tokens, i
            unfed = done.sampled[-1:]
            assert ctx.seq_pos_min(0) == 0 and ctx.seq_len(0) == len(transcripts[i]) - 1


def test_shift_refuses_what_cannot_fit_after_the_kept_prefix(tiny_model_path):
    with Scheduler(VramLedger(1 << 30), n_threads=1) as sched:
        sched.register("s", tiny_model_path, 256, policy="shift", keep=100)
        sched.decode("s", TURN, 100)
        before = sched.transcript("s")
        with pytest.raises(ContextFull, match="keeping its first 100 tokens leaves no room"):
            sched.decode("s", TURN, 160)
        assert sched.transcript("s") == before


def test_grow_charges_the_ledger_as_it_grows_within_bounded_headroom(tiny_model_path):
    shape = ModelShape.read(tiny_model_path)
    ledger = VramLedger(1 << 30)
    with Scheduler(ledger, n_threads=1, flash_attn="off") as sched:
        sched.register("g", tiny_model_path, 2048, policy="grow", min_ctx=256)
        sizes = []
        for n in (20, 200, 400, 600):
            sched.decode("g", TURN, n)
            info = {a.agent_id: a for a in sched.agents()}["g"]
            sizes.append(info.n_ctx)
            assert ledger.snapshot().by_owner["agent:g"] == info.context_bytes == context_estimate(
                shape, info.n_ctx).total_bytes
            assert info.n_ctx == 256 or info.n_ctx < 2 * info.held_tokens  # held plus bounded headroom
        assert sizes[0] == 256 and sizes == sorted(sizes) and sizes[-1] > 1024
        with pytest.raises(ContextFull, match="exceeds its n_ctx 2048 \\(policy=grow"):
            sched.decode("g", TURN, 1000)


def test_a_growth_the_ledger_refuses_keeps_the_agent_whole(tiny_model_path):
    shape = ModelShape.read(tiny_model_path)
    room = shape.weight_bytes(on_gpu=False) + context_estimate(shape, 512).total_bytes
    ledger = VramLedger(room)
    with Scheduler(ledger, n_threads=1, flash_attn="off") as sched:
        sched.register("g", tiny_model_path, 4096, policy="grow", min_ctx=256)
        sched.decode("g", TURN, 300)  # 256 -> 512 cells: admitted
        before = sched.transcript("g")
        with pytest.raises(LedgerDenied):
            sched.decode("g", TURN, 600)  # 1024 cells do not fit
        assert sched.transcript("g") == before
        assert {a.agent_id: a for a in sched.agents()}["g"].n_ctx == 512
        after = sched.decode("g", TURN, 8)  # restored from its swapped state
        assert after.restored and after.tokens
