"""``kvrt.cluster.affinity``: a request's route and rendezvous ranking (pure functions, no Ray needed).

The cluster itself, on a local Ray cluster, is ``tests/test_cluster.py``.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvrt.cluster.affinity import ANYWHERE, Route, ranked, route_of
from kvrt.serve.http_agents import HEADER

AGENT = HEADER.lower()
REPLICAS = [f"replica-{k}" for k in range(5)]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def test_the_header_names_the_agent_before_the_user_field():
    assert route_of({AGENT: "alice"}, body(user="bob", prompt="x")) == Route("agent\0alice", pinned=True)
    assert route_of({}, body(user="bob", prompt="x")) == Route("agent\0bob", pinned=True)


def test_an_invalid_agent_id_routes_anywhere_for_the_replica_to_refuse():
    assert route_of({AGENT: "not an id!"}, body(prompt="x")) == ANYWHERE
    assert route_of({}, body(user=7, prompt="x")) == ANYWHERE
    assert route_of({}, body(user="x" * 65)) == ANYWHERE


def test_an_anonymous_prompt_routes_by_its_opening_and_model():
    doc = "a shared document " * 100
    first = route_of({}, body(model="m", prompt=doc + "question one"), prefix_chars=1000)
    second = route_of({}, body(model="m", prompt=doc + "question two"), prefix_chars=1000)
    assert first == second and first.key is not None and not first.pinned
    assert route_of({}, body(model="other", prompt=doc), prefix_chars=1000) != first
    assert route_of({}, body(model="m", prompt="another document"), prefix_chars=1000) != first
    chat = [{"role": "system", "content": doc}, {"role": "user", "content": "q1"}]
    asked = route_of({}, body(model="m", messages=chat), prefix_chars=1000)
    chat[1]["content"] = "q2"
    assert route_of({}, body(model="m", messages=chat), prefix_chars=1000) == asked
    assert route_of({}, body(model="m", input=doc + "1"), prefix_chars=100) == \
        route_of({}, body(model="m", input=doc + "2"), prefix_chars=100)
    assert route_of({}, body(model="m", prompt=[1, 2, 3])).key is not None  # token ids too


def test_requests_without_a_prompt_go_anywhere():
    for raw in (b"", b"not json", b"[1, 2]", body(model="m"), body(model="m", prompt="")):
        assert route_of({}, raw) == ANYWHERE


@given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=50, unique=True))
def test_a_replica_leaving_moves_only_the_keys_it_won(keys: list[str]):
    before = {key: ranked(key, REPLICAS) for key in keys}
    for gone in REPLICAS:
        left = [r for r in REPLICAS if r != gone]
        for key, order in before.items():
            after = ranked(key, left)
            assert after == [r for r in order if r != gone]  # the same order, less the one gone
            if order[0] != gone:
                assert after[0] == order[0]


@given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=50, unique=True))
def test_a_replica_joining_takes_keys_only_for_itself(keys: list[str]):
    for key in keys:
        before, after = ranked(key, REPLICAS[:-1]), ranked(key, REPLICAS)
        assert after[0] in (before[0], REPLICAS[-1])


def test_ranking_is_the_same_in_any_order_of_replicas_and_spreads_keys():
    keys = [f"agent\0agent-{k}" for k in range(1000)]
    winners = [ranked(key, REPLICAS)[0] for key in keys]
    assert winners == [ranked(key, list(reversed(REPLICAS)))[0] for key in keys]
    counts = {replica: winners.count(replica) for replica in REPLICAS}
    assert min(counts.values()) > 100, counts  # 200 each expected; blake2b is fixed, so this never flakes
