"""kvrt replicas behind Ray Serve (``kvrt.cluster``) on a local Ray cluster on the CPU.

One module-wide cluster: ``ray.init(num_cpus=2)``, Serve's proxy on a free loopback port, two replicas of the tiny
F32 model (one thread, 1024 cells, split layout) behind the affinity ingress; beside it a single in-process server
(:func:`kvrt.serve.http_front.start_front`, what ``kvrt serve --http`` runs) on the same model as the reference.
Prompts are token lists and turns greedy with ``ignore_eos``, so outputs are fixed and compared for equality. Which
replica answered is read from the ``X-Kvrt-Replica`` header. No assertion depends on time.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _serving import turn_body

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'kvrt[cluster]')")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve import Application  # noqa: E402

from kvrt.accounting.ledger import VramLedger  # noqa: E402
from kvrt.cluster.affinity import ranked, route_of  # noqa: E402
from kvrt.cluster.app import build, from_args  # noqa: E402
from kvrt.cluster.replica import REPLICA_HEADER, ReplicaSpec  # noqa: E402
from kvrt.errors import KvrtError  # noqa: E402
from kvrt.runtime.admission import EngineConfig  # noqa: E402
from kvrt.serve.http_agents import HEADER  # noqa: E402
from kvrt.serve.http_front import HttpFront, HttpOptions, start_front  # noqa: E402
from kvrt.serve.registry import ModelRegistry  # noqa: E402

WAIT_S = 120.0
TURN_TOKENS = 6
Address = tuple[str, int]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def spec(model_path: Path) -> ReplicaSpec:
    return ReplicaSpec(http=HttpOptions(models=(model_path,)),
                       engine=EngineConfig(n_ctx=1024, n_seq_max=2, n_batch=512, n_threads=1, flash_attn="off",
                                           host_bytes=16 << 20, kv_layout="split"),
                       capacity_bytes=4 << 30, n_gpu_layers=0)


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path) -> Iterator[Address]:
    """Two kvrt replicas behind the affinity ingress; the address of Serve's HTTP proxy."""
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"KVRT_EXTRA_BUFTS": "off"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(spec(tiny_model_path), replicas=2, num_cpus=1), name="kvrt", route_prefix="/")
        yield "127.0.0.1", port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(tiny_model_path: Path) -> Iterator[Address]:
    """One server as ``kvrt serve --http`` starts it, on the replicas' options: the reference."""
    ledger = VramLedger(4 << 30)
    registry = ModelRegistry(ledger, n_gpu_layers=0, measure=False)
    front: HttpFront | None = None
    try:
        replica = spec(tiny_model_path)
        front = start_front(replica.http, replica.engine, registry, "127.0.0.1", 0)
        yield front.address
    finally:
        if front is not None:
            front.close()
        registry.close()
        ledger.close()


def call(address: Address, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(*address, timeout=WAIT_S)
    try:
        connection.request(method, path, None if body is None else json.dumps(body),
                           {"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def turn(address: Address, model: str, prompt: list[int], *, user: str | None = None, stream: bool = False,
         headers: dict[str, str] | None = None) -> tuple[list[int], int, str | None]:
    """One greedy turn of ``prompt``: its output tokens, the prompt tokens it found cached, the replica."""
    body = turn_body(model, prompt, TURN_TOKENS, user=user, stream=stream)
    status, answer_headers, raw = call(address, "POST", "/v1/completions", body, headers)
    assert status == 200, raw
    replica = answer_headers.get(REPLICA_HEADER.lower())
    if not stream:
        answer = json.loads(raw)
        return answer["choices"][0]["tokens"], answer["usage"]["prompt_tokens_details"]["cached_tokens"], replica
    assert answer_headers["content-type"].startswith("text/event-stream")
    text = raw.decode()
    assert text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    tokens = [t for c in chunks for choice in c["choices"] for t in choice.get("tokens", [])]
    return tokens, chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"], replica


def agents_on_both(cluster: Address, model: str, prompt: list[int]) -> dict[str, str]:
    """One turn each of agents ``agent-0``, ``agent-1``, ... until both replicas served some, 8 at least: the replica
    of each (replica ids are random, so which agents land where is known only once they are)."""
    served: dict[str, str] = {}
    for k in range(64):  # all 64 on one replica: 2 ** -63
        replica = turn(cluster, model, prompt, user=f"agent-{k}")[2]
        assert replica is not None
        served[f"agent-{k}"] = replica
        if k >= 7 and len(set(served.values())) == 2:
            return served
    raise AssertionError(f"64 agents, all on one replica: {set(served.values())}")


def test_an_agents_turns_stay_on_its_replica_and_find_its_history_cached(cluster: Address, tiny_model_path: Path,
                                                                          tiny_model):
    model = tiny_model_path.stem
    first = tiny_model.tokenize("The agent asks about the weather in the hills")
    out1, _, replica1 = turn(cluster, model, first, user="agent-a")
    second = first + out1 + tiny_model.tokenize(" and then about the roads", add_special=False)
    out2, cached, replica2 = turn(cluster, model, second, headers={HEADER: "agent-a"})
    third = second + out2 + tiny_model.tokenize(" and last the rivers", add_special=False)
    _, cached3, replica3 = turn(cluster, model, third, user="agent-a", stream=True)
    assert replica1 is not None and replica1 == replica2 == replica3
    assert cached == len(first) + len(out1) - 1  # its whole history but the last sampled token
    assert cached3 == len(second) + len(out2) - 1


def test_agents_spread_over_the_replicas_by_their_hash(cluster: Address, tiny_model_path: Path, tiny_model):
    model = tiny_model_path.stem
    prompt = tiny_model.tokenize("a short line")
    served = agents_on_both(cluster, model, prompt)
    replicas = sorted(set(served.values()))
    for agent, replica in served.items():
        key = route_of({HEADER.lower(): agent}, b"").key
        assert key is not None and replica == ranked(key, replicas)[0]
        assert turn(cluster, model, prompt, headers={HEADER: agent})[2] == replica  # the header: the same agent


def test_a_streamed_completion_passes_through_and_greedy_output_equals_a_single_server(
        cluster: Address, single: Address, tiny_model_path: Path, tiny_model):
    model = tiny_model_path.stem
    prompt = tiny_model.tokenize("A document every reader of the fan-out shares, then a question")
    reference, _, _ = turn(single, model, prompt)
    streamed, _, replica = turn(cluster, model, prompt, stream=True)
    unstreamed, cached, same = turn(cluster, model, prompt)
    assert streamed == unstreamed == reference
    assert replica == same  # an anonymous prompt goes by its opening: to the replica that has it cached
    assert cached == len(prompt) - 1


def test_the_answer_carries_the_proxys_own_date_and_server_once(cluster: Address):
    connection = http.client.HTTPConnection(*cluster, timeout=WAIT_S)
    try:
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        names = [name.lower() for name, _ in response.getheaders()]
        assert response.status == 200 and json.loads(response.read())["data"]
    finally:
        connection.close()
    assert names.count("date") == 1 and names.count("server") == 1 and names.count(REPLICA_HEADER.lower()) == 1


def test_the_example_serve_config_builds_and_bad_args_are_named():
    yaml = pytest.importorskip("yaml", reason="PyYAML reads Serve config files (it comes with ray)")
    config = yaml.safe_load((Path(__file__).parents[1] / "examples" / "ray_serve" / "serve_config.yaml").read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "kvrt.cluster.app:from_args"
    assert isinstance(from_args(application["args"]), Application)
    with pytest.raises(KvrtError, match=r"args.engine: unknown key\(s\) \['n_cxt'\]"):
        from_args({"engine": {"n_cxt": 4096}})
    with pytest.raises(KvrtError, match=r"unknown key\(s\) \['replica'\]"):
        from_args({"replica": 2})
    with pytest.raises(KvrtError, match="http.state_dir"):
        from_args({"http": {"state_dir": "/tmp/agents"}})


def test_a_body_over_the_limit_gets_the_single_servers_413(cluster: Address, single: Address,
                                                          tiny_model_path: Path):
    body = {"model": tiny_model_path.stem, "prompt": "x" * (4 << 20)}
    answers = [call(address, "POST", "/v1/completions", body) for address in (single, cluster)]
    assert [(status, json.loads(raw)["error"]["code"]) for status, _, raw in answers] == \
        [(413, "request_too_large")] * 2


def test_a_bad_agent_id_gets_the_single_servers_400(cluster: Address, single: Address, tiny_model_path: Path):
    body = {"model": tiny_model_path.stem, "prompt": "hello", "max_tokens": 2}
    for headers, user in (({HEADER: "not an id!"}, None), ({}, "x" * 65)):
        sent = {**body, **({"user": user} if user is not None else {})}
        expected = call(single, "POST", "/v1/completions", sent, headers)
        status, _, raw = call(cluster, "POST", "/v1/completions", sent, headers)
        assert (status, json.loads(raw)) == (expected[0], json.loads(expected[2]))
        assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_agent_id"


def test_a_replica_that_exits_moves_only_its_own_agents(cluster: Address, tiny_model_path: Path):
    """Last in this module: it kills a replica (Ray starts a replacement with a new id). Every request still gets
    an answer; an agent of the surviving replica stays there unless the replacement now wins its hash, and each
    agent goes to the rendezvous winner among the replicas alive."""
    model = tiny_model_path.stem
    before = agents_on_both(cluster, model, [1, 2, 3])
    agents = list(before)
    victim, survivor = sorted(set(before.values()))
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{victim}")]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for agent in agents:
        replica = turn(cluster, model, [1, 2, 3], user=agent)[2]
        key = route_of({HEADER.lower(): agent}, b"").key
        assert replica is not None and key is not None and replica != victim
        alive = [survivor] if replica == survivor else [survivor, replica]  # a replacement answered: it is alive
        assert ranked(key, alive)[0] == replica
