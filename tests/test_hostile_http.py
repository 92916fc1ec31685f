"""Hostile input at a live :class:`OpenAIServer` on the tiny test model: every one gets the right 4xx JSON.

Each case sends raw bytes over real HTTP (no client library smoothing them), checks the
status and the OpenAI error shape (``param`` naming the field where there is one), and
then a normal greedy request must still complete with the full output of an independent
reference (kvrt's one-sequence ``generate`` in a fresh context). Every wait is bounded;
nothing asserts on time.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra (pip install fastapi uvicorn openai) is not installed")

from kvrt import Context, GenerationParams, generate  # noqa: E402
from kvrt.engine.model import Model  # noqa: E402
from kvrt.engine.sampling import SamplingParams  # noqa: E402
from kvrt.runtime.admission import EngineConfig  # noqa: E402
from kvrt.runtime.batching import Engine  # noqa: E402
from kvrt.serve.openai_server import OpenAIServer  # noqa: E402

WAIT_S = 60.0
N_CTX = 512
MAX_INPUT_BYTES = 1 << 20
NORMAL = "A normal request after the hostile one"


@pytest.fixture(scope="module")
def served(tiny_model) -> Iterator[dict[str, Any]]:
    engine = Engine(tiny_model, EngineConfig(n_ctx=N_CTX, n_seq_max=4, n_batch=64, flash_attn="off"))
    server = OpenAIServer({"tiny": engine}, default_max_tokens=16, max_input_bytes=MAX_INPUT_BYTES)
    host, port = server.start("127.0.0.1", 0)
    try:
        yield {"server": server, "host": host, "port": port, "engine": engine}
    finally:
        server.stop()
        engine.close()


def send(served: dict[str, Any], path: str, body: Any, method: str = "POST") -> tuple[int, str, bytes]:
    """Status, content type and body of one request; ``body`` as bytes is sent as it is."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection(served["host"], served["port"], timeout=WAIT_S)
    try:
        connection.request(method, path, data, {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("content-type") or "", response.read()
    finally:
        connection.close()


def refused(served: dict[str, Any], path: str, body: Any, status: int = 400) -> dict[str, Any]:
    """The error object of a request that must be refused with ``status`` (and JSON, OpenAI-shaped)."""
    got, kind, raw = send(served, path, body)
    assert got == status, (got, raw[:500])
    assert kind.startswith("application/json"), (kind, raw[:500])
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def reference_text(tiny_model, prompt: str, max_tokens: int) -> str:
    tokens = tiny_model.tokenize(prompt, add_special=True, parse_special=True)
    with Context(tiny_model, n_ctx=N_CTX, flash_attn="off") as ctx:
        return generate(ctx, tokens, GenerationParams(max_tokens=max_tokens,
                                                      sampling=SamplingParams(temperature=0.0))).text


def assert_still_serves(served: dict[str, Any], tiny_model) -> None:
    status, _, raw = send(served, "/v1/completions", {"model": "tiny", "prompt": NORMAL, "max_tokens": 8,
                                                      "temperature": 0})
    assert status == 200, raw[:500]
    choice = json.loads(raw)["choices"][0]
    assert choice["text"] == reference_text(tiny_model, NORMAL, 8)


BASE = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("seed", [2**32 - 1, -1, 2**32, 2**63])
def test_seeds_that_are_not_reproducible_are_refused_naming_the_range(served, tiny_model, seed):
    error = refused(served, "/v1/completions", {**BASE, "seed": seed, "temperature": 1.0})
    assert error["param"] == "seed" and "4294967294" in error["message"], error
    assert_still_serves(served, tiny_model)


def test_the_largest_seed_is_reproducible(served):
    body = {**BASE, "seed": 2**32 - 2, "temperature": 1.0, "max_tokens": 12, "n": 2}
    first, again = (json.loads(send(served, "/v1/completions", body)[2]) for _ in range(2))
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]


def nested(depth: int) -> bytes:
    return b'{"model":"tiny","prompt":' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("body", [nested(2500), b'{"model":"tiny","prompt":"hi","x":' + b'{"a":' * 3000 + b"1"
                                  + b"}" * 3000 + b"}"], ids=["arrays", "objects"])
def test_deeply_nested_json_is_a_400(served, tiny_model, body):
    error = refused(served, "/v1/completions", body)
    assert "nest" in error["message"], error
    assert_still_serves(served, tiny_model)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model":"tiny","prompt":"\\ud800 lone","max_tokens":2}', "prompt"),
    ("/v1/completions", b'{"model":"tiny","prompt":["ok","\\udfff"],"max_tokens":2}', "prompt[1]"),
    ("/v1/completions", b'{"model":"tiny","prompt":[5,6,7,"\\ud800"],"max_tokens":2}', "prompt[3]"),  # ids, then text
    ("/v1/completions", b'{"model":"tiny","prompt":"hi","stop":["\\ud83d"],"max_tokens":2}', "stop[0]"),
    ("/v1/chat/completions", b'{"model":"tiny","messages":[{"role":"user","content":"a\\ud800"}]}',
     "messages[0].content"),
    ("/v1/kvrt/pins", b'{"model":"tiny","prompt":"\\udc00"}', "prompt"),
])
def test_lone_surrogates_are_a_400_naming_the_field(served, tiny_model, path, body, param):
    error = refused(served, path, body)
    assert error["param"] == param and "surrogate" in error["message"], error
    assert_still_serves(served, tiny_model)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 2**31), ("max_tokens", 2**64), ("n", 2**40), ("top_k", 2**31), ("logprobs", 2**31),
    ("stop_token_ids", [2**31]), ("stop_token_ids", [-1]),
])
def test_integers_are_checked_against_their_real_range(served, tiny_model, field, value):
    error = refused(served, "/v1/completions", {**BASE, field: value})
    assert error["param"] == (field if field != "stop_token_ids" else "stop_token_ids[0]"), error
    assert "penalty_last_n" not in error["message"]
    assert_still_serves(served, tiny_model)


@pytest.mark.parametrize("literal", [b"Infinity", b"-Infinity", b"NaN"])
@pytest.mark.parametrize("field", ["repetition_penalty", "temperature", "frequency_penalty", "top_p", "min_p"])
def test_non_finite_numbers_name_the_openai_field(served, field, literal):
    body = b'{"model":"tiny","prompt":"hi","max_tokens":2,"' + field.encode() + b'":' + literal + b"}"
    error = refused(served, "/v1/completions", body)
    assert error["param"] == field and "repeat_penalty" not in error["message"], error


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("max_tokens", "5"), ("max_tokens", 5.0), ("n", True), ("temperature", True),
    ("temperature", "0.5"), ("seed", "7"), ("stream", "yes"), ("stream", 1), ("echo", "no"), ("logprobs", False),
    ("top_k", "3"), ("stop_token_ids", [True]), ("prompt", [1, True]),
])
def test_types_are_strict(served, tiny_model, field, value):
    error = refused(served, "/v1/completions", {**BASE, field: value})
    assert error["param"] is not None and error["param"].split("[")[0] == field, error
    assert_still_serves(served, tiny_model)


def test_strict_chat_types(served):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for field, value in [("logprobs", "true"), ("max_completion_tokens", True),
                         ("stream_options", {"include_usage": 1})]:
        error = refused(served, "/v1/chat/completions", {**chat, field: value})
        assert error["param"].split(".")[0] == field, error


def test_integral_floats_stay_numbers_where_a_float_is_meant(served):
    status, _, raw = send(served, "/v1/completions", {**BASE, "temperature": 0, "top_p": 1, "min_p": 0})
    assert status == 200, raw[:300]


def test_a_streamed_request_refused_at_admission_gets_the_same_4xx_as_unstreamed(served, tiny_model):
    status, _, raw = send(served, "/v1/kvrt/pins", {"model": "tiny", "prompt": list(range(3, 403))})
    assert status == 200, raw[:300]
    pin = json.loads(raw)["id"]
    try:  # 400 of the 512 cells are pinned: 30 + 200 cells can never be had, which only admission knows
        body = {**BASE, "prompt": list(range(100, 130)), "max_tokens": 200}
        plain = refused(served, "/v1/completions", body)
        streamed = refused(served, "/v1/completions", {**body, "stream": True})
        assert streamed == plain and plain["code"] == "context_length_exceeded", (plain, streamed)
        assert "pinned" in plain["message"]
    finally:
        assert send(served, f"/v1/kvrt/pins/{pin}", None, method="DELETE")[0] == 200
    assert_still_serves(served, tiny_model)


def test_a_stream_still_streams(served, tiny_model):
    status, kind, raw = send(served, "/v1/completions", {**BASE, "prompt": NORMAL, "max_tokens": 8, "stream": True})
    assert status == 200 and kind.startswith("text/event-stream")
    lines = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference_text(tiny_model, NORMAL, 8)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


TREE_DEFS = {"node": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                       "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                                "maxItems": 2}},
                      "required": ["name", "kids"]}}


def schema_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, "max_tokens": 24, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "t", "schema": schema}}}


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/node", "$defs": TREE_DEFS},
    {"$ref": "#/definitions/node", "definitions": {"node": {**TREE_DEFS["node"], "properties": {
        "name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/definitions/node"}}}}}},
    {"type": "object", "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["name", "kids"]},
], ids=["root-ref-defs", "root-ref-definitions", "whole-document"])
def test_recursive_json_schemas_are_served(served, tiny_model, schema):
    status, _, raw = send(served, "/v1/completions", schema_body(schema))
    assert status == 200, raw[:500]
    text = json.loads(raw)["choices"][0]["text"]
    assert text.startswith("{"), text  # the grammar holds the output (24 tokens rarely close the tree)
    assert_still_serves(served, tiny_model)


@pytest.mark.parametrize("schema, says", [
    ({"$ref": "https://example.com/tree.json"}, "only local references"),
    ({"$ref": "#/$defs/missing", "$defs": {}}, "'#/$defs/missing' does not resolve"),
    ({"$ref": "other.json#/a"}, "only local references"),
])
def test_unsupported_schema_refs_are_named(served, schema, says):
    error = refused(served, "/v1/completions", schema_body(schema))
    assert error["param"] == "response_format" and says in error["message"], error


def test_a_body_over_the_input_cap_is_a_413_naming_the_limit(served, tiny_model):
    error = refused(served, "/v1/completions", {**BASE, "prompt": "x" * (MAX_INPUT_BYTES + 10)}, status=413)
    assert str(MAX_INPUT_BYTES) in error["message"] and "max-input-bytes" in error["message"], error
    assert_still_serves(served, tiny_model)


@pytest.fixture
def no_huge_tokenization(monkeypatch):
    """Model.tokenize that fails loudly on a text too long to fit: the server must refuse it before tokenizing."""
    tokenize = Model.tokenize

    def guarded(self, text, **kw):
        assert len(text) < 50_000, "a text far longer than the context was tokenized"
        return tokenize(self, text, **kw)

    monkeypatch.setattr(Model, "tokenize", guarded)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**BASE, "prompt": "many words " * 30_000}, "prompt"),
    ("/v1/kvrt/pins", {"model": "tiny", "prompt": "many words " * 30_000}, "prompt"),
    ("/v1/kvrt/fork", {**BASE, "completion_id": "cmpl-none", "prompt": "w " * 100_000}, "prompt"),
])
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(served, tiny_model, no_huge_tokenization, path, body,
                                                               param):
    if path == "/v1/kvrt/fork":  # a real completion to continue
        status, _, raw = send(served, "/v1/completions", {**BASE, "prompt": NORMAL})
        body = {**body, "completion_id": json.loads(raw)["id"]}
    error = refused(served, path, body)
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert str(N_CTX) in error["message"], error
    assert_still_serves(served, tiny_model)


def test_tokenization_does_not_block_other_clients(served, tiny_model, monkeypatch):
    entered, finished = threading.Event(), threading.Event()
    tokenize = Model.tokenize

    def slow(self, text, **kw):
        if "SLOW" in text:
            entered.set()
            threading.Event().wait(10.0)  # stands for a long tokenization (bounded: a blocked loop fails late)
            finished.set()
        return tokenize(self, text, **kw)

    monkeypatch.setattr(Model, "tokenize", slow)
    slow_request = threading.Thread(target=send, args=(served, "/v1/completions", {**BASE, "prompt": "SLOW"}))
    slow_request.start()
    try:
        assert entered.wait(WAIT_S)
        status, _, raw = send(served, "/v1/models", None, method="GET")
        assert status == 200 and not finished.is_set(), "the event loop waited for a tokenization"
    finally:
        slow_request.join(WAIT_S)


def test_pinning_a_cached_prompt_twice_answers_and_leaves_no_slot_active(served, tiny_model):
    body = {"model": "tiny", "prompt": "a document pinned twice " * 3}
    ids = []
    for expected_cached in (False, True):
        status, _, raw = send(served, "/v1/kvrt/pins", body)
        assert status == 200, raw[:300]
        pin = json.loads(raw)
        assert (pin["cached_tokens"] == pin["tokens"]) is expected_cached, pin
        ids.append(pin["id"])
    assert "active" not in served["engine"].stats().slots
    for pin_id in ids:
        assert send(served, f"/v1/kvrt/pins/{pin_id}", None, method="DELETE")[0] == 200
    assert_still_serves(served, tiny_model)
