"""The batching engine's agents: round-robin admission by agent, an agent's history kept over anonymous prefixes,
a finished request's KV handed out (``Request.at_end``) and put back into another engine (``Engine.preload``).

The tiny F32 model with flash attention off is exact under batching and prefix reuse, so tokens are compared for
equality. Admission order is fixed by a closed ``before_step`` gate while everything is queued: no assertion
depends on time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import numpy as np
import pytest

from kvrt.engine.generation import GenerationParams
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import KvrtError
from kvrt.runtime.batching import Engine
from kvrt.runtime.host_tier import ALIGN, HostTier
from kvrt.runtime.requests import AgentBusy, Request
from test_batching import StepGate
from test_batching import engine as batching_engine

WAIT_S = 60.0


def greedy(max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))


def engine(model, gate: StepGate | None = None, **config) -> AbstractContextManager[Engine]:
    """test_batching's engine, two slots in the split layout unless ``config`` says otherwise."""
    return batching_engine(model, gate, **{"n_seq_max": 2, "kv_layout": "split", **config})


def test_queued_requests_are_admitted_round_robin_by_agent(tiny_model):
    """One slot, everything queued before the first step: agent a's three requests do not all go before b's one
    or the anonymous one (first come first served would give a1 a2 a3 b1 c)."""
    order: list[str] = []
    gate = StepGate()
    with engine(tiny_model, gate, n_seq_max=1, kv_layout="unified") as eng:
        streams = []
        for name, agent in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("c", None)]:
            def done(ctx, slot, tokens, name=name) -> None:
                order.append(name)
            streams.append(eng.submit(Request(tiny_model.tokenize(f"request {name}"), greedy(3), agent=agent,
                                              at_end=done)))
        gate.open()
        for stream in streams:
            stream.result(WAIT_S)
    assert order == ["a1", "b1", "c", "a2", "a3"]


def test_without_agents_the_queue_stays_first_come_first_served(tiny_model):
    order: list[int] = []
    gate = StepGate()
    with engine(tiny_model, gate, n_seq_max=1, kv_layout="unified") as eng:
        streams = [eng.submit(Request(tiny_model.tokenize(f"prompt {i}"), greedy(2),
                                      at_end=lambda ctx, slot, tokens, i=i: order.append(i))) for i in range(4)]
        gate.open()
        for stream in streams:
            stream.result(WAIT_S)
    assert order == [0, 1, 2, 3]


def test_an_agents_cached_history_outlives_an_anonymous_prefix(tiny_model):
    """Two slots, both cached: the agent's (least recently used) and an anonymous one. A third conversation
    evicts the anonymous slot, not the agent's, so the agent's next turn finds all of its history."""
    mine = tiny_model.tokenize("the agent's own long conversation " * 3)
    with engine(tiny_model, n_seq_max=2) as eng:
        first = eng.submit(Request(mine, greedy(4), agent="agent-1")).result(WAIT_S).choices[0].tokens
        for text in ("someone anonymous asks", "yet another question"):  # no BOS: no prefix shared with the agent
            eng.submit(Request(tiny_model.tokenize(text, add_special=False), greedy(4))).result(WAIT_S)
        history = mine + first[:-1]
        assert eng.cache.longest_prefix(history)[1] == len(history)
        assert eng.cache.owner(eng.cache.longest_prefix(history)[0]) == "agent-1"
        turn = eng.submit(Request(history + tiny_model.tokenize(" next", add_special=False), greedy(2),
                                  agent="agent-1")).result(WAIT_S)
    assert turn.end.cached_tokens == len(history)


def test_another_agent_does_not_cut_an_agents_history_short(tiny_model):
    """Agent b's prompt shares most of agent a's cached slot; with no free slot it gets a copy in the other slot
    (anonymous, evicted) instead of truncating a's history in place."""
    shared = tiny_model.tokenize("a long common preamble that both agents start with, " * 3)
    with engine(tiny_model, n_seq_max=2) as eng:
        a = eng.submit(Request(shared + tiny_model.tokenize(" a", add_special=False), greedy(3),
                               agent="a")).result(WAIT_S)
        eng.submit(Request(tiny_model.tokenize("filler"), greedy(2))).result(WAIT_S)
        eng.submit(Request(shared + tiny_model.tokenize(" b", add_special=False), greedy(3),
                           agent="b")).result(WAIT_S)
        a_history = shared + tiny_model.tokenize(" a", add_special=False) + a.choices[0].tokens[:-1]
        assert eng.cache.longest_prefix(a_history)[1] == len(a_history)


def test_a_finished_turns_kv_put_into_another_engine_continues_it_exactly(tiny_model):
    """``at_end`` copies the slot's state as the turn ends; ``preload`` puts it into a fresh engine's host tier;
    the next turn there restores all of it (nothing prefilled but the new tokens) and its output is that of the
    first engine continuing the conversation itself."""
    prompt = tiny_model.tokenize("an agent's first turn, long enough to be worth keeping: " * 2)
    kept: list[tuple[tuple[int, ...], np.ndarray]] = []

    def copy_out(ctx, slot, tokens) -> None:
        state = np.empty(ctx.seq_state_size(slot), dtype=np.uint8)
        kept.append((tokens, state[:ctx.seq_state_get(slot, state)].copy()))

    with engine(tiny_model) as one:
        first = one.submit(Request(prompt, greedy(6), agent="a", at_end=copy_out)).result(WAIT_S)
        (tokens, state), = kept
        assert list(tokens) == prompt + first.choices[0].tokens[:-1]
        following = list(tokens) + tiny_model.tokenize(" and the next", add_special=False)
        expected = one.submit(Request(following, greedy(6), agent="a")).result(WAIT_S)
    with engine(tiny_model, host_bytes=1 << 24) as two:
        assert two.preload(tokens, state, owner="a").result(WAIT_S)
        before = two.stats()
        again = two.submit(Request(following, greedy(6), agent="a")).result(WAIT_S)
        after = two.stats()
    assert again.choices[0].tokens == expected.choices[0].tokens
    assert again.end.cached_tokens == after.restored_tokens - before.restored_tokens == len(tokens)
    assert after.prefilled_tokens - before.prefilled_tokens == len(following) - len(tokens)


def test_preload_runs_the_check_first_and_needs_a_host_tier(tiny_model):
    def refuse(ctx) -> None:
        raise KvrtError("not this context")

    with engine(tiny_model, host_bytes=1 << 20) as eng:
        with pytest.raises(KvrtError, match="not this context"):
            eng.preload([1, 2, 3], np.zeros(8, dtype=np.uint8), check=refuse).result(WAIT_S)
    with engine(tiny_model, host_bytes=0) as eng:
        assert eng.preload([1, 2, 3], np.zeros(8, dtype=np.uint8)).result(WAIT_S) is False


def test_at_end_is_not_called_for_a_cancelled_or_failed_request(tiny_model):
    calls: list[int] = []
    gate = StepGate()
    with engine(tiny_model, gate) as eng:
        stream = eng.submit(Request(tiny_model.tokenize("cancel me"), greedy(50),
                                    at_end=lambda ctx, slot, tokens: calls.append(slot)))
        stream.cancel()
        gate.open()
        assert stream.result(WAIT_S).choices[0].finish_reason == "cancelled"
    assert calls == []


def test_the_host_tier_drops_anonymous_copies_before_an_agents():
    tier = HostTier(2 * ALIGN, min_tokens=1)
    assert tier.keep([1, 2], ALIGN, lambda view: ALIGN, owner="a")
    assert tier.keep([3, 4], ALIGN, lambda view: ALIGN)
    assert tier.keep([5, 6], ALIGN, lambda view: ALIGN)  # room for two: one leaves
    assert tier.longest([1, 2])[1] == 2 and tier.longest([3, 4])[1] == 0
    assert tier.longest([1, 2])[0].owner == "a"


def test_hand_over_takes_an_agents_slot_or_host_copy_and_refuses_while_it_runs(tiny_model):
    """``hand_over`` gives the agent's cached slot and empties it; put back into the host tier, it gives that copy;
    a queued or running request of the agent refuses it."""
    prompt = tiny_model.tokenize("an agent's history that is about to move elsewhere: " * 2)
    with engine(tiny_model, host_bytes=1 << 24) as eng:
        first = eng.submit(Request(prompt, greedy(4), agent="a")).result(WAIT_S).choices[0].tokens
        assert eng.hand_over("nobody").result(WAIT_S) is None
        tokens, state = eng.hand_over("a").result(WAIT_S)
        assert list(tokens) == prompt + first[:-1] and state.nbytes > 0
        assert eng.cached_prefix(prompt).result(WAIT_S) == 0 and eng.hand_over("a").result(WAIT_S) is None
        assert eng.preload(tokens, state, owner="a").result(WAIT_S)  # back, as a host copy
        back, _ = eng.hand_over("a").result(WAIT_S)
        assert back == tokens and eng.cached_prefix(prompt).result(WAIT_S) == 0
    gate = StepGate()
    with engine(tiny_model, gate) as eng:
        eng.submit(Request(prompt, greedy(4), agent="a"))
        refused = eng.hand_over("a")
        gate.allow(1)  # the command runs before that step admits the request: it is queued
        with pytest.raises(AgentBusy, match="queued or running"):
            refused.result(WAIT_S)
