"""AgentContext: one sequence live in a charged context or swapped out; every step keeps the ledger and the KV exact."""

from __future__ import annotations

import numpy as np
import pytest

from kvrt.accounting.estimate import ModelShape
from kvrt.accounting.ledger import LedgerDenied, VramLedger
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.state.agent_context import AgentContext
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import SnapshotMismatch

TOKENS = [(11 * i) % 400 + 5 for i in range(300)]
NEXT = 7


def make(model: Model, ledger: VramLedger | None, n_ctx: int = 512, owner: str = "agent:a") -> AgentContext:
    return AgentContext(model, ModelShape.read(model.path), ContextParams(n_ctx=n_ctx), ledger, owner, n_ctx,
                        pool=HostPool())


def next_logits(kv: AgentContext) -> np.ndarray:
    """The logits after feeding NEXT at the sequence's end (then taken back out: the sequence is unchanged)."""
    ctx = kv.ctx
    assert ctx is not None
    held = ctx.seq_len(0)
    row = prefill(ctx, [NEXT], start_pos=held)
    logits = ctx.logits(row).copy()
    ctx.seq_rm(0, held, -1)
    return logits


def filled(model: Model, ledger: VramLedger | None, **kw) -> AgentContext:
    kv = make(model, ledger, **kw)
    kv.open()
    prefill(kv.ctx, TOKENS, logits_last=False)
    return kv


def test_open_charges_its_estimate_before_the_context_exists_and_free_gives_it_back(tiny_model):
    ledger = VramLedger(capacity_bytes=1 << 34)
    kv = make(tiny_model, ledger)
    assert kv.ctx is None and ledger.allocated_bytes == 0 and kv.nbytes == kv.estimate(512) > 0
    kv.open()
    assert kv.ctx is not None and ledger.snapshot().by_owner == {"agent:a": kv.nbytes}
    kv.free()
    assert kv.ctx is None and ledger.allocated_bytes == 0


def test_a_refused_open_creates_nothing_and_keeps_the_snapshot(tiny_model):
    ledger = VramLedger(capacity_bytes=1 << 34)
    kv = filled(tiny_model, ledger)
    before = next_logits(kv)
    assert kv.swap_out(TOKENS) > 0 and kv.n_tokens == len(TOKENS) and kv.ctx.seq_len(0) == 0
    kv.free()
    assert kv.snapshot is not None and kv.n_tokens == len(TOKENS) and ledger.allocated_bytes == 0
    hog = ledger.try_reserve(ledger.snapshot().max_bytes - kv.nbytes + 1, "other")
    with pytest.raises(LedgerDenied):
        kv.open()
    assert kv.ctx is None and kv.snapshot is not None and ledger.allocated_bytes == hog.nbytes
    ledger.release(hog)
    kv.open()
    assert kv.swap_in() > 0 and kv.snapshot is None and kv.n_tokens == len(TOKENS)
    np.testing.assert_array_equal(next_logits(kv), before)
    kv.close()
    assert ledger.allocated_bytes == 0


def test_swap_out_keeps_the_context_for_a_hand_over_and_adopt_moves_the_charge(tiny_model):
    ledger = VramLedger(capacity_bytes=1 << 34)
    a = filled(tiny_model, ledger, owner="agent:a")
    b = make(tiny_model, ledger, owner="agent:b")
    nbytes = a.swap_out(TOKENS)
    assert nbytes == a.snapshot.nbytes and a.ctx is not None and a.ctx.seq_len(0) == 0  # emptied, still live
    b.adopt(a.detach())
    assert a.ctx is None and b.ctx is not None and ledger.snapshot().by_owner == {"agent:b": b.nbytes}
    b.close()
    a.close()
    assert ledger.allocated_bytes == 0


def test_move_to_a_larger_context_carries_the_sequence_exactly_and_holds_one_charge_after(tiny_model):
    ledger = VramLedger(capacity_bytes=1 << 34)
    kv = filled(tiny_model, ledger)
    before = next_logits(kv)
    move = kv.move(1024)
    assert kv.n_ctx == kv.ctx.n_ctx == 1024 and kv.n_tokens == len(TOKENS) and move.state_bytes > 0
    assert ledger.snapshot().by_owner == {"agent:a": kv.nbytes} and kv.nbytes == kv.estimate(1024)
    np.testing.assert_array_equal(next_logits(kv), before)
    kv.close()


def test_a_refused_move_leaves_the_old_context_live_and_the_ledger_as_it_was(tiny_model):
    ledger = VramLedger(capacity_bytes=1 << 34)
    kv = filled(tiny_model, ledger)
    before, books = next_logits(kv), ledger.snapshot()
    hog = ledger.try_reserve(books.max_bytes - books.allocated_bytes - kv.estimate(1024) + 1, "other")
    with pytest.raises(LedgerDenied):
        kv.move(1024)
    ledger.release(hog)
    assert kv.n_ctx == 512 and kv.n_tokens == len(TOKENS) and ledger.snapshot() == books
    np.testing.assert_array_equal(next_logits(kv), before)
    kv.close()


def test_a_failed_swap_in_frees_the_context_and_keeps_the_snapshot(tiny_model, other_tiny_model_path):
    ledger = VramLedger(capacity_bytes=1 << 34)
    with Model(other_tiny_model_path) as other:
        source = filled(other, None)
        source.swap_out(TOKENS)
        kv = make(tiny_model, ledger)
        kv.snapshot, source.snapshot = source.snapshot, None  # another model's state
        kv.open()
        with pytest.raises(SnapshotMismatch):
            kv.swap_in()
        assert kv.ctx is None and kv.snapshot is not None and ledger.allocated_bytes == 0
        kv.close()
        source.close()
    assert kv.snapshot is None
