"""Operator routes of :class:`OpenAIServer` on the tiny test model: health, API keys, tokenize.

A live server on 127.0.0.1 (an ephemeral port) is driven over real HTTP; where a state
cannot be reached over a socket (a server that stopped accepting closes its socket), the
app is driven in-process through Starlette's test client. Every wait is bounded; nothing
asserts on time.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra (pip install fastapi uvicorn openai) is not installed")

from fastapi.testclient import TestClient  # noqa: E402

from kvrt.engine.batching import Engine, EngineConfig  # noqa: E402
from kvrt.serve.openai_server import OpenAIServer  # noqa: E402

WAIT_S = 60.0
KEY = "sk-kvrt-test-key"


@pytest.fixture(scope="module")
def engine(tiny_model) -> Iterator[Engine]:
    engine = Engine(tiny_model, EngineConfig(n_ctx=512, n_seq_max=4, n_batch=64, flash_attn="off"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served(engine) -> Iterator[dict[str, Any]]:
    server = OpenAIServer({"tiny": engine}, default_max_tokens=8)
    host, port = server.start("127.0.0.1", 0)
    try:
        yield {"server": server, "host": host, "port": port}
    finally:
        server.stop()


def send(served: dict[str, Any], method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """Status and JSON body of one request."""
    connection = http.client.HTTPConnection(served["host"], served["port"], timeout=WAIT_S)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, data, {"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_health_is_ok_with_each_models_queue_and_active_requests(served, engine):
    status, body = send(served, "GET", "/health")
    stats = engine.stats()  # idle: exact
    assert status == 200
    assert body == {"status": "ok", "models": {"tiny": {"queued": stats.queued, "active": stats.active}}}


def test_health_is_503_once_the_server_stops_accepting(engine):
    server = OpenAIServer({"tiny": engine})
    try:
        with TestClient(server.app) as client:
            assert client.get("/health").status_code == 200
            server.stop_accepting()
            response = client.get("/health")
        assert response.status_code == 503
        assert response.json()["status"] == "shutting_down"
        assert set(response.json()["models"]) == {"tiny"}
    finally:
        server.stop()
