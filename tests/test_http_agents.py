"""Agents over HTTP (``kvrt serve --http --state-dir``): identity, turns saved before they are answered, restored
after a restart token-identically, damaged entries named and skipped, one process per state dir.

Servers run in-process through ``kvrt.commands._http.start_http`` (the command's own start-up, options parsed by
its parser) on the tiny F32 model; a second process is a real ``kvrt serve``. Prompts are token lists and every
turn is greedy with ``ignore_eos``, so a turn's output is fixed and comparable for equality. No assertion depends
on time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from _serving import turn_body

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from kvrt.accounting.ledger import VramLedger  # noqa: E402
from kvrt.commands import _http, serve  # noqa: E402
from kvrt.serve.registry import ModelRegistry  # noqa: E402

WAIT_S = 120.0
KVRT = [sys.executable, "-m", "kvrt.cli"]
TURN_TOKENS = 6


@contextmanager
def http_front(model_path: Path, state_dir: Path | None, *options: str) -> Iterator[_http.HttpFront]:
    """``kvrt serve --http 127.0.0.1:0`` on ``model_path`` (split layout, a host tier) in this process."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--http", "127.0.0.1:0", "--model", str(model_path), "--n-ctx", "1024", "--slots", "2",
                              "--threads", "1", "--kv-layout", "split", "--host-mib", "16", "--flash-attn", "off",
                              *(["--state-dir", str(state_dir)] if state_dir is not None else []), *options])
    ledger = VramLedger(4 << 30)
    registry = ModelRegistry(ledger, n_gpu_layers=0, measure=False)
    try:
        front = _http.start_http(args, registry)
        try:
            yield front
        finally:
            front.close()
    finally:
        registry.close()
        ledger.close()


def call(front: _http.HttpFront, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    host, port = front.address
    connection = http.client.HTTPConnection(host, port, timeout=WAIT_S)
    try:
        connection.request(method, path, None if body is None else json.dumps(body),
                           {"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if not raw.startswith(b"data:") else raw.decode()
    finally:
        connection.close()


def turn(front: _http.HttpFront, prompt: list[int], *, user: str | None = None, stream: bool = False,
         headers: dict[str, str] | None = None) -> tuple[list[int], int]:
    """One greedy turn of ``prompt``: its output tokens and the prompt tokens it found cached."""
    model = next(iter(front.pool.engines))
    body = turn_body(model, prompt, TURN_TOKENS, user=user, stream=stream)
    status, answer = call(front, "POST", "/v1/completions", body, headers)
    assert status == 200, answer
    if not stream:
        return answer["choices"][0]["tokens"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    chunks = [json.loads(line[6:]) for line in answer.splitlines() if line.startswith("data: {")]
    assert answer.rstrip().endswith("data: [DONE]")
    tokens = [t for c in chunks for choice in c["choices"] for t in choice.get("tokens", [])]
    return tokens, chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]


def stats(front: _http.HttpFront) -> dict[str, Any]:
    status, answer = call(front, "GET", "/v1/kvrt/stats")
    assert status == 200
    return answer


def manifest(state_dir: Path, agent: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((state_dir / "http" / f"{agent}.agent.json").read_bytes())["record"]
    return record


def words(model, text: str) -> list[int]:
    return model.tokenize(text, add_special=False)


def three_turns(front: _http.HttpFront, model, agent: str | None, upto: int = 3,
                outputs: list[list[int]] | None = None) -> list[tuple[list[int], list[int], int]]:
    """Turns 1..``upto`` of one conversation (each prompt: the last one, its output, a new line of the user's):
    (prompt, output, cached) each. ``outputs``: earlier turns' outputs, for a conversation continued elsewhere."""
    prompt = model.tokenize("The agent's first question is about the weather in the hills")
    done: list[tuple[list[int], list[int], int]] = []
    for k in range(upto):
        lines = [" and then the second question", " and finally the third question"]
        if outputs is not None and k < len(outputs):
            out, cached = outputs[k], -1
        else:
            out, cached = turn(front, prompt, user=agent, stream=k == 1)
        done.append((prompt, out, cached))
        if k < 2:
            prompt = prompt + out + words(model, lines[k])
    return done


def test_an_agent_survives_a_restart_token_identically(tmp_path: Path, tiny_model_path: Path, tiny_model):
    """Turns 1 and 2 on server A (turn 2 streamed), each saved before it was answered; server B on the same
    state dir answers turn 3 as an uninterrupted server does, token for token, restoring the whole history
    (cached_tokens, the engine's restored and prefilled counters) instead of prefilling it."""
    with http_front(tiny_model_path, None) as plain:
        reference = three_turns(plain, tiny_model, "agent-1")
    state = tmp_path / "state"
    with http_front(tiny_model_path, state) as a:
        first = three_turns(a, tiny_model, "agent-1", upto=1)
        (p1, o1, _), = first
        assert manifest(state, "agent-1")["transcript"] == p1 + o1[:-1]  # on disk before the answer came
        two = three_turns(a, tiny_model, "agent-1", upto=2, outputs=[o1])
        p2, o2, _ = two[1]
        assert manifest(state, "agent-1")["transcript"] == p2 + o2[:-1]  # streamed: on disk before [DONE]
        assert stats(a)["kvrt:agents"]["saved_turns"] == 2
    assert [o for _, o, _ in two] == [o for _, o, _ in reference[:2]]
    with http_front(tiny_model_path, state) as b:
        assert b.server.agents.prefetching is not None and b.server.agents.prefetching.result(WAIT_S) == 1
        agents = stats(b)["kvrt:agents"]
        assert agents["waiting_to_restore"] == 0 and agents["prefetched"] == 1  # from disk into host memory at start
        before = stats(b)[tiny_model_path.stem]
        p3, o3, cached = three_turns(b, tiny_model, "agent-1", outputs=[o1, o2])[2]
        after = stats(b)[tiny_model_path.stem]
    history = len(p2) + len(o2) - 1
    assert p3 == reference[2][0]
    assert o3 == reference[2][1]
    assert cached == reference[2][2] == history
    assert after["restored_tokens"] - before["restored_tokens"] == history
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == len(p3) - history


def test_a_damaged_entry_is_named_and_skipped_and_the_others_come_back(tmp_path: Path, tiny_model_path: Path,
                                                                       tiny_model, caplog):
    state = tmp_path / "state"
    prompts = {name: tiny_model.tokenize(f"agent {name} opens its own conversation with a long line")
               for name in ("good", "bad")}
    with http_front(tiny_model_path, state) as a:
        outputs = {name: turn(a, prompt, user=name)[0] for name, prompt in prompts.items()}
    (kv,) = (state / "http").glob("bad+*.kvs")
    data = bytearray(kv.read_bytes())
    data[len(data) // 2] ^= 0xFF
    kv.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvrt.serve.http_agents"), http_front(tiny_model_path, state) as b:
        assert b.server.agents.prefetching is not None and b.server.agents.prefetching.result(WAIT_S) == 1
        agents = stats(b)["kvrt:agents"]
        assert [(p["agent"], p["file"]) for p in agents["problems"]] == [("bad", kv.name)]
        assert agents["waiting_to_restore"] == 0 and agents["prefetched"] == 1  # the good one
        good = prompts["good"] + outputs["good"] + words(tiny_model, " go on")
        bad = prompts["bad"] + outputs["bad"] + words(tiny_model, " go on")
        assert turn(b, good, user="good")[1] == len(good) - len(words(tiny_model, " go on")) - 1
        assert turn(b, bad, user="bad")[1] < len(prompts["bad"])  # started fresh: nothing of its history
        assert stats(b)["kvrt:agents"]["unsaved"] == {}
    assert any("'bad'" in r.getMessage() and kv.name in r.getMessage() for r in caplog.records)
    assert manifest(state, "bad")["transcript"][:len(bad)] == bad  # its new turn saved over the damaged entry


def test_an_agent_saved_with_another_model_is_refused_not_the_server(tmp_path: Path, tiny_model_path: Path,
                                                                     other_tiny_model_path: Path, tiny_model):
    model = tmp_path / "served.gguf"
    shutil.copyfile(tiny_model_path, model)
    state = tmp_path / "state"
    prompt = tiny_model.tokenize("a conversation with the first model's weights")
    with http_front(model, state) as a:
        turn(a, prompt, user="agent-1")
    shutil.copyfile(other_tiny_model_path, model)  # another model at the same path
    with http_front(model, state) as b:
        (problem,) = stats(b)["kvrt:agents"]["problems"]
        assert problem["agent"] == "agent-1" and "not the one agent 'agent-1' was saved with" in problem["reason"]
        assert turn(b, prompt + words(tiny_model, " more"), user="agent-1")[1] == 0  # fresh, served


def test_a_second_process_on_the_same_state_dir_is_refused(tmp_path: Path, tiny_model_path: Path):
    state = tmp_path / "state"
    with http_front(tiny_model_path, state):
        proc = subprocess.run([*KVRT, "serve", "--http", "127.0.0.1:0", "--model", str(tiny_model_path),
                               "--state-dir", str(state), "--n-ctx", "512", "--slots", "1", "--threads", "1"],
                              capture_output=True, text=True, timeout=WAIT_S,
                              env={**os.environ, "KVRT_EXTRA_BUFTS": "off"})
    assert proc.returncode != 0
    assert f"state directory {state / 'http'} is in use by another daemon" in proc.stderr


@pytest.mark.parametrize(("headers", "user", "param"), [
    ({"X-Kvrt-Agent": "has space"}, None, "X-Kvrt-Agent"),
    ({"X-Kvrt-Agent": "x" * 65}, None, "X-Kvrt-Agent"),
    ({}, "a/b", "user"),
    ({}, 42, "user"),
    ({}, "", "user"),
])
def test_a_bad_agent_id_is_a_400_naming_its_field(tiny_model_path: Path, tiny_model, headers, user, param):
    with http_front(tiny_model_path, None) as front:
        body: dict[str, Any] = {"model": tiny_model_path.stem, "prompt": "hi", "max_tokens": 2, "user": user}
        for path, extra in [("/v1/completions", {}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/responses", {"input": "hi"})]:
            status, answer = call(front, "POST", path, {**body, **extra}, headers)
            assert status == 400, (path, answer)
            assert answer["error"]["param"] == param and param in answer["error"]["message"]


def test_the_header_names_the_agent_over_user(tmp_path: Path, tiny_model_path: Path, tiny_model):
    state = tmp_path / "state"
    prompt = tiny_model.tokenize("whose turn is this")
    with http_front(tiny_model_path, state) as front:
        turn(front, prompt, user="not/an id", headers={"X-Kvrt-Agent": "from-header"})
        turn(front, prompt, user="from-user")
    assert sorted(p.name for p in (state / "http").glob("*.agent.json")) == ["from-header.agent.json",
                                                                             "from-user.agent.json"]


def test_anonymous_requests_save_nothing(tmp_path: Path, tiny_model_path: Path, tiny_model):
    state = tmp_path / "state"
    with http_front(tiny_model_path, state) as front:
        turn(front, tiny_model.tokenize("nobody in particular"))
        assert stats(front)["kvrt:agents"]["saved_turns"] == 0
    assert not list((state / "http").glob("*.agent.json"))


def test_the_start_prefetch_stops_once_the_host_tier_is_full(tmp_path: Path, tiny_model_path: Path, tiny_model):
    """Three saved agents of ~600 tokens (~600 KB of KV each) and a 1 MiB host tier: the prefetch puts one, the
    second pushes it out (a drop), and the third is left for its first request instead of pushing out more."""
    state = tmp_path / "state"
    long = ["--n-ctx", "4096", "--host-mib", "1"]
    with http_front(tiny_model_path, state, *long) as a:
        for name in ("x", "y", "z"):
            turn(a, tiny_model.tokenize(f"agent {name} " + "talks at length " * 150)[:600], user=name)
    with http_front(tiny_model_path, state, *long) as b:
        assert b.server.agents.prefetching is not None and b.server.agents.prefetching.result(WAIT_S) == 2
        agents = stats(b)["kvrt:agents"]
        assert agents["prefetched"] == 2 and agents["waiting_to_restore"] == 1 and agents["problems"] == []
