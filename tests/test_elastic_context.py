"""Elastic llama.cpp contexts: greedy tokens equal a fixed large context's; every size is charged."""

from __future__ import annotations

import numpy as np
import pytest

from kvrt.accounting.ledger import LedgerDenied, VramLedger
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.errors import KvrtError
from kvrt.memory.elastic_context import ElasticContext

GREEDY = GenerationParams(max_tokens=40)


def text(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return " ".join("".join(rng.choice(letters, rng.integers(2, 8))) for _ in range(n_words))


def test_greedy_tokens_equal_a_fixed_context_across_growth_swap_and_turns(tiny_model):
    turns = [text(120, 1), text(60, 2), text(5, 3)]
    with Context(tiny_model, n_ctx=2048) as fixed:
        expected = [generate(fixed, turn, GREEDY).tokens for turn in turns]
    ledger = VramLedger(capacity_bytes=1 << 34)
    with ElasticContext(tiny_model, max_ctx=2048, min_ctx=256, ledger=ledger) as agent:
        assert agent.n_ctx == 256 and ledger.allocated_bytes == agent.context_bytes(256)
        got = [agent.generate(turns[0], GREEDY).tokens]
        assert agent.n_ctx >= agent.n_tokens and len(agent.resizes) >= 1
        assert all(r.to_ctx >= 2 * r.from_ctx for r in agent.resizes)  # geometric
        assert ledger.allocated_bytes == agent.context_bytes(agent.n_ctx) == agent.charged_bytes
        held = agent.n_tokens
        assert agent.swap_out() > 0 and ledger.allocated_bytes == 0 and agent.n_tokens == held
        got.append(agent.generate(turns[1], GREEDY).tokens)  # swapped back in, then grown
        got.append(agent.generate(turns[2], GREEDY).tokens)
        assert ledger.allocated_bytes == agent.context_bytes(agent.n_ctx)
    assert got == expected
    assert ledger.allocated_bytes == 0


def test_shrink_to_fit_moves_an_idle_agent_down_and_keeps_its_tokens(tiny_model):
    prompt = tiny_model.tokenize(text(40, 4))
    with Context(tiny_model, n_ctx=2048) as fixed:
        expected = generate(fixed, prompt, GREEDY).tokens
    with ElasticContext(tiny_model, max_ctx=2048, min_ctx=256) as agent:
        agent.ensure(1500)
        assert agent.n_ctx == 2048
        agent.prefill(prompt[:10])
        agent.shrink_to_fit()
        assert agent.n_ctx == 256 and agent.n_tokens == 10
        agent.ctx.seq_rm(0)
        assert agent.generate(prompt, GREEDY).tokens == expected


def test_a_denied_growth_changes_nothing(tiny_model):
    probe = ElasticContext(tiny_model, max_ctx=4096, min_ctx=256)
    cap = probe.context_bytes(512) + probe.context_bytes(256)  # room for 256 -> 512, not -> 1024
    probe.close()
    ledger = VramLedger(capacity_bytes=cap)
    with ElasticContext(tiny_model, max_ctx=4096, min_ctx=256, ledger=ledger) as agent:
        agent.prefill(tiny_model.tokenize(text(60, 5)))
        assert agent.n_ctx == 512
        held, charged = agent.n_tokens, ledger.allocated_bytes
        with pytest.raises(LedgerDenied):
            agent.ensure(600)
        assert (agent.n_ctx, agent.n_tokens, ledger.allocated_bytes) == (512, held, charged)
        with pytest.raises(KvrtError, match="exceed this agent's max_ctx"):
            agent.ensure(5000)
    with pytest.raises(KvrtError, match="multiple of 256"):
        ElasticContext(tiny_model, max_ctx=1024, min_ctx=100)


def test_a_growth_carrying_the_held_state_keeps_the_tokens(tiny_model):
    prompt = tiny_model.tokenize(text(200, 6))[:250]  # 200 held, then 50 + 40 generated: 290 cells
    with Context(tiny_model, n_ctx=1024) as fixed:
        prefill(fixed, prompt[:200], logits_last=False)
        expected = generate(fixed, prompt[200:], GREEDY).tokens
    with ElasticContext(tiny_model, max_ctx=1024, min_ctx=256) as agent:
        agent.prefill(prompt[:200])
        got = agent.generate(prompt[200:], GREEDY).tokens
        assert [(r.from_ctx, r.to_ctx, r.n_tokens) for r in agent.resizes] == [(256, 512, 200)]
    assert got == expected


def test_generation_is_sized_up_front_and_grow_ahead_moves_between_turns(tiny_model):
    turns = [tiny_model.tokenize(text(200, 7))[:250], tiny_model.tokenize(text(200, 8))[:200]]
    with Context(tiny_model, n_ctx=2048) as fixed:
        expected = [generate(fixed, turn, GREEDY).tokens for turn in turns]
    ledger = VramLedger(capacity_bytes=1 << 34)
    with ElasticContext(tiny_model, max_ctx=2048, min_ctx=256, ledger=ledger) as agent:
        got = [agent.generate(turns[0], GREEDY).tokens]
        # 250 + 40 does not fit 256 cells: one move before the prefill, carrying nothing
        assert [(r.from_ctx, r.to_ctx, r.n_tokens, r.on_path) for r in agent.resizes] == [(256, 512, 0, True)]
        assert agent.grow_ahead(fill=0.9) is None  # 290 of 512 cells: under the threshold
        ahead = agent.grow_ahead(fill=0.5)
        assert ahead is not None and (ahead.from_ctx, ahead.to_ctx, ahead.on_path) == (512, 1024, False)
        assert ahead.n_tokens == agent.n_tokens and ledger.allocated_bytes == agent.context_bytes(1024)
        got.append(agent.generate(turns[1], GREEDY).tokens)  # 290 + 200 + 40 fits: no move on the path
        assert len(agent.resizes) == 2
    assert got == expected
    assert ledger.allocated_bytes == 0


class CountingContext(Context):
    """Counts the llama.cpp contexts created, to see which growth created one on the path."""

    created = 0

    def __init__(self, *args, **kwargs) -> None:
        type(self).created += 1
        super().__init__(*args, **kwargs)


def test_prepared_spares_are_used_no_context_is_created_on_the_path_and_tokens_stay_equal(tiny_model, monkeypatch):
    monkeypatch.setattr("kvrt.state.sized_context.Context", CountingContext)
    turns = [tiny_model.tokenize(text(200, 9))[:300], tiny_model.tokenize(text(200, 10))[:400]]
    with Context(tiny_model, n_ctx=1024) as fixed:
        expected = [generate(fixed, turn, GREEDY).tokens for turn in turns]
    ledger = VramLedger(capacity_bytes=1 << 34)
    # registration: the 256-cell context plus a spare for the first request (300 + 40 -> 512 cells)
    with ElasticContext(tiny_model, max_ctx=1024, min_ctx=256, ledger=ledger,
                        expected_tokens=len(turns[0]) + GREEDY.max_tokens) as agent:
        assert (agent.n_ctx, agent.spare_ctx) == (256, 512) and CountingContext.created == 2
        assert ledger.allocated_bytes == agent.charged_bytes == agent.context_bytes(256) + agent.context_bytes(512)
        assert ledger.snapshot().by_owner == {"agent:elastic": agent.context_bytes(256),
                                                "agent:elastic:spare": agent.context_bytes(512)}
        before = CountingContext.created
        got = [agent.generate(turns[0], GREEDY).tokens]
        assert CountingContext.created == before  # the growth moved into the spare
        move = agent.resizes[-1]
        assert (move.from_ctx, move.to_ctx, move.on_path, move.spare, move.create_s) == (256, 512, True, True, 0.0)
        assert agent.spares[0].outcome == "used" and agent.spares[0].held_s >= 0 and agent.spare_ctx == 0
        assert ledger.allocated_bytes == agent.charged_bytes == agent.context_bytes(512)
        assert ledger.snapshot().by_owner == {"agent:elastic": agent.context_bytes(512)}
        # between the turns: keep one spare of the next bucket (off the path); turn 2 (339 + 400 + 40) needs it
        assert agent.prepare() == 1024 and CountingContext.created == before + 1
        assert agent.prepare() == 1024 and CountingContext.created == before + 1  # already held: nothing new
        before, held = CountingContext.created, agent.n_tokens
        got.append(agent.generate(turns[1], GREEDY).tokens)
        assert CountingContext.created == before
        move = agent.resizes[-1]
        assert (move.from_ctx, move.to_ctx, move.spare) == (512, 1024, True) and move.n_tokens == held
        assert agent.prepare() is None and agent.spare_ctx == 0  # at max_ctx: nothing to prepare
        assert all(r.on_path and r.spare for r in agent.resizes) and len(agent.resizes) == 2
    assert got == expected
    assert ledger.allocated_bytes == 0


def test_ledger_counts_the_spare_and_gets_it_back_when_it_is_dropped(tiny_model):
    ledger = VramLedger(capacity_bytes=1 << 34)
    with ElasticContext(tiny_model, max_ctx=4096, min_ctx=256, ledger=ledger) as agent:
        live = agent.context_bytes(256)
        assert agent.prepare(100) is None and agent.spares == []  # fits the live context: no spare
        assert agent.prepare(1500) == 2048
        assert (ledger.allocated_bytes == agent.charged_bytes == live + agent.context_bytes(2048)
                == live + agent.spare_bytes)
        assert agent.prepare(700) == 2048  # a larger spare is held: kept
        assert agent.drop_spare() == agent.context_bytes(2048)
        assert ledger.allocated_bytes == agent.charged_bytes == live and agent.spares[0].outcome == "dropped"
        assert agent.prepare() == 512 and agent.prepare(3000) == 4096  # a smaller spare is replaced
        assert [s.outcome for s in agent.spares] == ["dropped", "dropped", "held"]
        assert ledger.allocated_bytes == live + agent.context_bytes(4096)
        agent.prefill(tiny_model.tokenize(text(20, 11)))
        agent.shrink_to_fit()  # an idle agent's step gives the spare back too
        assert agent.spare_ctx == 0 and ledger.allocated_bytes == live
        agent.prepare(3000)
        agent.swap_out()
        assert ledger.allocated_bytes == 0 and agent.spare_ctx == 0 and agent.prepare(3000) is None
        agent.swap_in()
        agent.prepare(3000)
    assert ledger.allocated_bytes == 0 and agent.spares[-1].outcome == "dropped"


def test_a_refused_spare_changes_nothing_and_growth_falls_back_to_creating(tiny_model):
    probe = ElasticContext(tiny_model, max_ctx=4096, min_ctx=256)
    b = probe.context_bytes
    cap = b(256) + b(1024)  # room for a 512 spare or a 1024 context beside the first, never for a 2048 one
    probe.close()
    ledger = VramLedger(capacity_bytes=cap)
    prompt = tiny_model.tokenize(text(200, 12))[:600]
    with Context(tiny_model, n_ctx=1024) as fixed:
        expected = generate(fixed, prompt, GREEDY).tokens
    with ElasticContext(tiny_model, max_ctx=4096, min_ctx=256, ledger=ledger, expected_tokens=1500) as agent:
        # refused at registration
        assert agent.spare_ctx == 0 and agent.spares == [] and ledger.allocated_bytes == b(256)
        assert agent.prepare(400) == 512
        state = (agent.n_ctx, agent.spare_ctx, ledger.allocated_bytes, len(agent.spares), agent.spares[0].outcome)
        assert agent.prepare(1500) is None  # a 2048 spare does not fit: the 512 one stays
        assert (agent.n_ctx, agent.spare_ctx, ledger.allocated_bytes, len(agent.spares),
                agent.spares[0].outcome) == state
        # 640 cells: the 512 spare is too small, so it is dropped and 1024 is created on demand
        got = agent.generate(prompt, GREEDY).tokens
        move = agent.resizes[-1]
        assert (move.to_ctx, move.spare) == (1024, False) and move.create_s > 0
        assert agent.spare_ctx == 0 and agent.spares[0].outcome == "dropped"
        assert ledger.allocated_bytes == b(1024)
    assert got == expected and ledger.allocated_bytes == 0
