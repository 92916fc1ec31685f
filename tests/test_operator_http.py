"""Operator routes of :class:`OpenAIServer` on the tiny test model: health, API keys, tokenize.

A live server on 127.0.0.1 (an ephemeral port) is driven over real HTTP; where a state
cannot be reached over a socket (a server that stopped accepting closes its socket), the
app is driven in-process through Starlette's test client. Every wait is bounded; nothing
asserts on time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra (pip install fastapi uvicorn openai) is not installed")

from fastapi.testclient import TestClient  # noqa: E402

from kvrt.cli import build_parser  # noqa: E402
from kvrt.commands import serve  # noqa: E402
from kvrt.errors import KvrtError  # noqa: E402
from kvrt.runtime.admission import EngineConfig  # noqa: E402
from kvrt.runtime.batching import Engine  # noqa: E402
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
    server = OpenAIServer({"tiny": engine}, default_max_tokens=8, api_key=KEY)
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


BEARER = {"authorization": f"Bearer {KEY}"}


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


def test_the_right_key_works_with_the_openai_client(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{served['host']}:{served['port']}/v1", api_key=KEY, max_retries=0,
                           timeout=WAIT_S)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens == 4


def test_a_wrong_key_raises_authentication_error_in_the_openai_client(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{served['host']}:{served['port']}/v1", api_key=KEY + "x",
                           max_retries=0, timeout=WAIT_S)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                                     {"authorization": "Basic " + KEY}, {"authorization": "Bearer "}])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                              ("GET", "/v1/kvrt/stats")])
def test_a_missing_or_wrong_key_is_401_in_openais_shape(served, headers, method, path):
    status, body = send(served, method, path, {"model": "tiny", "prompt": "x"} if method == "POST" else None,
                        headers)
    assert status == 401
    assert set(body) == {"error"}
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert "API key" in error["message"] and KEY not in error["message"]


def test_health_needs_no_key(served):
    assert send(served, "GET", "/health")[0] == 200
    assert send(served, "GET", "/health", headers=BEARER)[0] == 200


@pytest.mark.parametrize("key", ["", " padded "])
def test_an_empty_or_padded_key_is_refused(engine, key):
    with pytest.raises(KvrtError, match="api_key"):
        OpenAIServer({"tiny": engine}, api_key=key)


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def test_api_key_comes_from_kvrt_api_key_and_the_option_wins(monkeypatch):
    monkeypatch.delenv("KVRT_API_KEY", raising=False)
    assert parse_serve([]).api_key is None
    monkeypatch.setenv("KVRT_API_KEY", "")  # empty: unset
    assert parse_serve([]).api_key is None
    monkeypatch.setenv("KVRT_API_KEY", "from-env")
    assert parse_serve([]).api_key == "from-env"
    assert parse_serve(["--api-key", "from-option"]).api_key == "from-option"


@pytest.fixture(scope="module")
def reference_vocab(tiny_model_path) -> Any:
    """llama-cpp-python's high-level tokenizer on the same file: the independent reference."""
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(tiny_model_path), vocab_only=True, verbose=False)


@pytest.mark.parametrize("add_special", [False, True])
@pytest.mark.parametrize("text", ["Hello world", "  spaces\tand\nnewlines ", "naïve café ☕", ""])
def test_tokenize_and_detokenize_match_llama_cpp_python(served, reference_vocab, text, add_special):
    status, body = send(served, "POST", "/tokenize", {"content": text, "add_special": add_special}, BEARER)
    assert status == 200
    expected = reference_vocab.tokenize(text.encode(), add_bos=add_special, special=True)
    assert body == {"tokens": expected}
    status, body = send(served, "POST", "/detokenize", {"tokens": expected, "model": "tiny"}, BEARER)
    assert status == 200
    assert body == {"content": reference_vocab.detokenize(expected, special=True).decode("utf-8", "replace")}


def test_tokenize_defaults_to_no_special_tokens_like_llama_server(served, reference_vocab):
    status, body = send(served, "POST", "/tokenize", {"content": "Hello"}, BEARER)
    assert (status, body) == (200, {"tokens": reference_vocab.tokenize(b"Hello", add_bos=False, special=True)})


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_an_unknown_model_is_404(served, path):
    body = {"content": "x", "model": "nope"} if path == "/tokenize" else {"tokens": [1], "model": "nope"}
    status, answer = send(served, "POST", path, body, BEARER)
    assert status == 404
    assert (answer["error"]["param"], answer["error"]["code"]) == ("model", "model_not_found")


@pytest.mark.parametrize(("tokens", "param"), [([1, 10**6], "tokens[1]"), ([-1], "tokens[0]"),
                                               ([1, 2, "3"], "tokens[2]")])
def test_tokens_outside_the_vocabulary_are_400_naming_the_field(served, tiny_model, tokens, param):
    status, answer = send(served, "POST", "/detokenize", {"tokens": tokens}, BEARER)
    assert status == 400
    assert answer["error"]["param"] == param
    assert answer["error"]["message"].startswith(param)


def test_the_routes_need_the_key(served):
    assert send(served, "POST", "/tokenize", {"content": "x"})[0] == 401
    assert send(served, "POST", "/detokenize", {"tokens": [1]})[0] == 401


def test_a_server_with_several_models_needs_the_model_named(engine):
    server = OpenAIServer({"a": engine, "b": engine})
    try:
        with TestClient(server.app) as client:
            refused = client.post("/tokenize", json={"content": "x"})
            named = client.post("/tokenize", json={"content": "x", "model": "b"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        assert named.status_code == 200 and named.json()["tokens"] == engine.model.tokenize("x", add_special=False)
    finally:
        server.stop()


def scrape(served: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    connection = http.client.HTTPConnection(served["host"], served["port"], timeout=WAIT_S)
    try:
        connection.request("GET", "/metrics", headers=BEARER)
        response = connection.getresponse()
        assert response.status == 200
        text = response.read().decode()
    finally:
        connection.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_requests_tokens_and_latencies(served):
    before = scrape(served)
    plain = send(served, "POST", "/v1/completions", {"model": "tiny", "prompt": "Count me", "max_tokens": 5,
                                                    "temperature": 0, "ignore_eos": True}, BEARER)[1]["usage"]
    connection = http.client.HTTPConnection(served["host"], served["port"], timeout=WAIT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "Stream me", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}}),
            {"content-type": "application/json", **BEARER})
        chunks = [line for line in connection.getresponse().read().decode().split("\n\n") if line]
    finally:
        connection.close()
    streamed = json.loads(chunks[-2].removeprefix("data: "))["usage"]
    send(served, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})  # no key: 401
    send(served, "GET", "/no/such/route", headers=BEARER)
    after = scrape(served)

    assert delta(before, after, "kvrt_http_requests_total", route="/v1/completions", status="2xx") == 2
    assert delta(before, after, "kvrt_http_requests_total", route="/v1/completions", status="4xx") == 1
    assert delta(before, after, "kvrt_http_requests_total", route="other", status="4xx") == 1
    assert delta(before, after, "kvrt_prompt_tokens_total", model="tiny") == (plain["prompt_tokens"]
                                                                              + streamed["prompt_tokens"])
    assert delta(before, after, "kvrt_completion_tokens_total", model="tiny") == 5 + 3
    assert (plain["completion_tokens"], streamed["completion_tokens"]) == (5, 3)
    assert delta(before, after, "kvrt_time_to_first_token_seconds_count", model="tiny") == 2
    assert delta(before, after, "kvrt_inter_token_latency_seconds_count", model="tiny") == (5 - 1) + (3 - 1)
    assert delta(before, after, "kvrt_time_to_first_token_seconds_bucket", model="tiny", le="+Inf") == 2


def test_metrics_show_each_engines_state(served, engine):
    samples = scrape(served)
    stats = engine.stats()  # idle between requests: exact
    model = (("model", "tiny"),)
    assert samples[("kvrt_queued_requests", model)] == stats.queued == 0
    assert samples[("kvrt_active_requests", model)] == stats.active == 0
    assert samples[("kvrt_kv_cells_used", model)] == stats.used_cells
    assert samples[("kvrt_kv_cells", model)] == stats.n_cells
    assert samples[("kvrt_prefix_reused_tokens_total", model)] == stats.reused_tokens
    assert samples[("kvrt_prefilled_tokens_total", model)] == stats.prefilled_tokens
    assert samples[("kvrt_kv_layout_info", (("layout", stats.kv_layout), ("model", "tiny")))] == 1


def test_metrics_need_the_key_and_servers_keep_their_own_registries(served, engine):
    assert send_raw_status(served, "/metrics") == 401
    first, second = OpenAIServer({"tiny": engine}), OpenAIServer({"tiny": engine})  # no duplicate-metric error
    try:
        assert first.metrics.registry is not second.metrics.registry
    finally:
        first.stop()
        second.stop()


def send_raw_status(served: dict[str, Any], path: str) -> int:
    connection = http.client.HTTPConnection(served["host"], served["port"], timeout=WAIT_S)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


UNHONOURED = {"typical_p": 0.5, "tfs_z": 0.9, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2,
              "dynatemp_range": 0.5, "grammar": "root ::= \"a\"", "guided_json": {"type": "object"},
              "top_n_sigma": 1.0, "best_of": 3, "use_beam_search": True, "min_tokens": 2}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("name", "value"), sorted(UNHONOURED.items()))
def test_an_unhonoured_sampling_parameter_is_400_naming_it(served, path, name, value):
    body: dict[str, Any] = {"model": "tiny", name: value}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    status, answer = send(served, "POST", path, body, BEARER)
    assert status == 400
    assert (answer["error"]["param"], answer["error"]["code"]) == (name, "unsupported_parameter")
    assert answer["error"]["message"].startswith(f"{name}: kvrt does not implement")


def test_the_400_names_every_unhonoured_parameter(served):
    body = {"model": "tiny", "prompt": "x", "typical_p": 0.5, "mirostat": 1, "xtc_probability": 0.3}
    status, answer = send(served, "POST", "/v1/completions", body, BEARER)
    assert status == 400
    assert answer["error"]["message"].startswith("typical_p, mirostat, xtc_probability: ")


def test_neutral_values_of_unhonoured_parameters_are_accepted(served):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "typical_p": 1, "mirostat": 0, "tfs_z": 1.0,
            "grammar": None, "use_beam_search": False}
    status, answer = send(served, "POST", "/v1/completions", body, BEARER)
    assert status == 200, answer


def test_a_bool_is_not_a_neutral_number(served):
    status, answer = send(served, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "mirostat": False},
                          BEARER)
    assert (status, answer["error"]["param"]) == (400, "mirostat")


def test_one_info_line_per_request(served, caplog):
    caplog.set_level(logging.INFO, logger="kvrt.serve.http")
    status, answer = send(served, "POST", "/v1/completions", {"model": "tiny", "prompt": "Log me", "max_tokens": 3,
                                                              "temperature": 0, "ignore_eos": True}, BEARER)
    assert status == 200
    usage = answer["usage"]
    ours = f"prompt_tokens={usage['prompt_tokens']} completion_tokens=3 ttft_ms="  # not an earlier test's late line
    limit = time.monotonic() + WAIT_S  # the line is written once the answer is sent: wait for it, bounded
    while not (lines := [r for r in caplog.records if r.name == "kvrt.serve.http"
                         and "/v1/completions" in r.getMessage() and ours in r.getMessage()]) \
            and time.monotonic() < limit:
        time.sleep(0.01)
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    message = lines[0].getMessage()
    assert message.startswith("POST /v1/completions model=tiny status=200 ")
    assert re.search(r"ttft_ms=\d+\.\d total_ms=\d+\.\d$", message)


def test_an_int_option_from_the_environment_and_the_command_line_wins(monkeypatch):
    monkeypatch.delenv("KVRT_N_CTX", raising=False)
    assert parse_serve([]).n_ctx == 4096
    monkeypatch.setenv("KVRT_N_CTX", "1024")
    assert parse_serve([]).n_ctx == 1024
    assert parse_serve(["--n-ctx", "2048"]).n_ctx == 2048
    monkeypatch.setenv("KVRT_N_CTX", "0")
    assert parse_serve(["--n-ctx", "2048"]).n_ctx == 2048  # a bad variable the command line overrides is unused


def test_a_bad_int_from_the_environment_is_reported_by_its_option(monkeypatch, capsys):
    monkeypatch.setenv("KVRT_N_CTX", "lots")
    with pytest.raises(SystemExit):
        parse_serve([])
    assert "--n-ctx" in capsys.readouterr().err


def test_a_choice_from_the_environment_is_checked(monkeypatch, capsys):
    monkeypatch.setenv("KVRT_KV_LAYOUT", "unified")
    assert parse_serve([]).kv_layout == "unified"
    assert parse_serve(["--kv-layout", "split"]).kv_layout == "split"
    monkeypatch.setenv("KVRT_KV_LAYOUT", "sideways")
    with pytest.raises(SystemExit):
        parse_serve([])
    err = capsys.readouterr().err
    assert "--kv-layout" in err and "sideways" in err


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("no", False), ("1", True), ("On", True)])
def test_a_flag_from_the_environment_and_the_command_line_wins(monkeypatch, value, expected):
    monkeypatch.setenv("KVRT_PREFETCH", value)
    assert parse_serve([]).prefetch is expected
    assert parse_serve(["--prefetch"]).prefetch is True
    assert parse_serve(["--no-prefetch"]).prefetch is False


def test_a_flag_that_is_not_yes_or_no_is_refused_by_its_option_and_only_where_used(monkeypatch, capsys):
    monkeypatch.setenv("KVRT_PREFETCH", "maybe")
    with pytest.raises(SystemExit):
        parse_serve([])
    assert "argument --prefetch/--no-prefetch: KVRT_PREFETCH='maybe' is not a yes or no" in capsys.readouterr().err
    assert parse_serve(["--prefetch"]).prefetch is True  # the command line wins: the variable is unused
    assert build_parser().parse_args(["doctor"]).command == "doctor"  # other commands are not affected


def test_models_from_the_environment_split_on_pathsep(monkeypatch):
    monkeypatch.setenv("KVRT_MODEL", os.pathsep.join(["a.gguf", "b.gguf"]))
    assert parse_serve([]).model == ["a.gguf", "b.gguf"]


def test_help_names_every_options_variable():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    text = " ".join(parser.format_help().split())  # help wraps lines anywhere
    options = [o for action in parser._actions for o in action.option_strings[:1] if o.startswith("--")]
    assert {"--n-ctx", "--kv-layout", "--prefetch", "--api-key", "--http"} <= set(options)
    for option in options:
        assert f"[env KVRT_{option[2:].upper().replace('-', '_')}]" in text, option
