"""Elastic llama.cpp contexts: greedy tokens equal a fixed large context's; every size is charged."""

from __future__ import annotations

import numpy as np
import pytest

from kvrt.context import Context
from kvrt.elastic_context import ElasticContext
from kvrt.errors import KvrtError
from kvrt.generation import GenerationParams, generate
from kvrt.ledger import LedgerDenied, VramLedger

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


def test_growth_in_the_middle_of_decoding_keeps_the_tokens(tiny_model):
    prompt = tiny_model.tokenize(text(200, 6))[:250]  # 250 + 40 generated crosses the 256-cell bucket
    with Context(tiny_model, n_ctx=1024) as fixed:
        expected = generate(fixed, prompt, GREEDY).tokens
    with ElasticContext(tiny_model, max_ctx=1024, min_ctx=256, size_for_generation=False) as agent:
        got = agent.generate(prompt, GREEDY).tokens
        assert [(r.from_ctx, r.to_ctx) for r in agent.resizes] == [(256, 512)]
        assert agent.resizes[0].n_tokens >= 256 - 1  # it moved while decoding, not during the prefill
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
