"""``kvrt serve --http`` as a user starts it: a real process, driven by the official ``openai`` client.

The in-process server's behaviour is covered in ``test_openai_server.py``; this checks the
command itself: it prints where it listens, streams a chat completion, constrains output to a
JSON schema, refuses a bad address or no front at all, and exits 0 on SIGTERM (both fronts in one process:
``test_serve_both_fronts.py``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serve extra (pip install fastapi uvicorn openai) is not installed")
jsonschema = pytest.importorskip("jsonschema")

WAIT_S = 120.0
KVRT = [sys.executable, "-m", "kvrt.cli"]


@contextlib.contextmanager
def serving(*options: str) -> Iterator[str]:
    """``kvrt serve --http 127.0.0.1:0 OPTIONS...`` as a process; yields its base URL, then stops it with SIGTERM
    and checks it exits 0."""
    proc = subprocess.Popen([*KVRT, "serve", "--http", "127.0.0.1:0", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        found = re.search(r"(http://\S+/v1)", line)
        if not found:
            proc.kill()
            pytest.fail(f"kvrt serve --http printed {line!r}; stderr: {proc.communicate(timeout=WAIT_S)[1][-2000:]}")
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0, proc.stderr.read()[-2000:] if proc.stderr else ""


@pytest.fixture(scope="module")
def server(demo_model_path: Path) -> Iterator[str]:
    """``kvrt serve --http`` on the demo model; yields its base URL."""
    with serving("--model", str(demo_model_path), "--n-ctx", "2048", "--slots", "2", "--threads", "1") as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=WAIT_S)


def test_streaming_chat_completion(client, demo_model_path: Path):
    stream = client.chat.completions.create(model=demo_model_path.stem, stream=True, max_tokens=12, temperature=0,
                                            messages=[{"role": "user", "content": "Name three colours."}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and text.strip()
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}


def test_json_schema_completion(client, demo_model_path: Path):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    response = client.chat.completions.create(
        model=demo_model_path.stem, max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Invent a person; answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


@pytest.mark.parametrize("option, value", [
    ("--max-tokens", "-5"), ("--max-tokens", "0"), ("--request-timeout-s", "-1"), ("--request-timeout-s", "nan"),
    ("--request-timeout-s", "inf"), ("--shutdown-timeout-s", "nan"), ("--max-input-bytes", "0"), ("--n-ctx", "-1"),
    ("--slots", "0"), ("--max-queue", "-3"),
])
def test_bad_numbers_are_refused_naming_the_option(option: str, value: str):
    done = subprocess.run([*KVRT, "serve", "--http", "127.0.0.1:0", option, value], capture_output=True, text=True,
                          timeout=WAIT_S, env={**os.environ, "KVRT_EXTRA_BUFTS": "off"})
    assert done.returncode == 2 and option in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_an_address_that_cannot_be_served_is_one_error_line(demo_model_path: Path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for address, says in [(f"127.0.0.1:{taken.getsockname()[1]}", "in use"),
                              ("no-such-host.invalid:8000", "no-such-host.invalid")]:
            done = subprocess.run([*KVRT, "serve", "--http", address, "--model", str(demo_model_path), "--threads",
                                   "1"], capture_output=True, text=True, timeout=WAIT_S,
                                  env={**os.environ, "KVRT_EXTRA_BUFTS": "off"})
            assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr
            assert says in done.stderr and address in done.stderr, done.stderr
    finally:
        taken.close()


@pytest.mark.parametrize("args, says", [
    (["--http", "localhost"], "HOST:PORT"),
    ([], "needs --socket PATH"),
])
def test_bad_invocations_are_refused_with_the_reason(args: list[str], says: str):
    done = subprocess.run([*KVRT, "serve", *args], capture_output=True, text=True, timeout=WAIT_S,
                          env={**os.environ, "KVRT_EXTRA_BUFTS": "off"})
    assert done.returncode == 2 and says in done.stderr, done.stderr


def _start(demo_model_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*KVRT, "serve", "--http", "127.0.0.1:0", "--model", str(demo_model_path), "--n-ctx",
                             "4096", "--slots", "2", "--threads", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    found = re.search(r"http://([^/\s]+)/v1", line)
    if not found:
        proc.kill()
        pytest.fail(f"kvrt serve --http printed {line!r}")
    return proc, found.group(1)


def _open_stream(address: str, model: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A chat stream long enough to outlast the test (4000 tokens on a CPU), its first chunk read."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    body = {"model": model, "stream": True, "max_tokens": 4000, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 100000, one number per line."}]}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    return connection, response


def test_sigterm_ends_open_streams_and_exits_0(demo_model_path: Path):
    proc, address = _start(demo_model_path, "--shutdown-timeout-s", "60")
    try:
        connection, response = _open_stream(address, demo_model_path.stem)
        proc.send_signal(signal.SIGTERM)
        rest = response.read().decode()  # the stream ends (bounded by the connection's timeout)
        events = [e.removeprefix("data: ") for e in rest.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]", rest[-500:]
        assert "closed" in json.loads(events[-2])["error"]["message"], rest[-500:]  # ended by the shutdown
        assert proc.wait(timeout=WAIT_S) == 0
        connection.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_second_sigterm_exits_at_once_with_status_1(demo_model_path: Path):
    proc, address = _start(demo_model_path)
    try:
        connection, response = _open_stream(address, demo_model_path.stem)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) in (0, 1)  # 0 when the first one's shutdown won the race
        connection.close()
    finally:
        proc.kill()
        proc.wait()


def test_models_dir_beside_model_lists_both_and_loads_on_demand(tmp_path: Path, tiny_model_path: Path,
                                                               other_tiny_model_path: Path):
    models = tmp_path / "models"
    models.mkdir()
    (models / other_tiny_model_path.name).write_bytes(other_tiny_model_path.read_bytes())
    with serving("--model", str(tiny_model_path), "--models-dir", str(models), "--n-ctx", "512", "--slots", "2",
                 "--threads", "1", "--host-mib", "0") as url:
        address = url.removeprefix("http://").removesuffix("/v1")
        listed = {card["id"]: card["loaded"] for card in _get(address, "/v1/models")["data"]}
        assert listed == {tiny_model_path.stem: True, other_tiny_model_path.stem: False}
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=WAIT_S)
        reply = client.completions.create(model=other_tiny_model_path.stem, prompt=[1, 2, 3], max_tokens=3,
                                          temperature=0)
        assert reply.usage.completion_tokens == 3
        assert all(card["loaded"] for card in _get(address, "/v1/models")["data"])


def _get(address: str, path: str) -> dict:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    try:
        connection.request("GET", path)
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()
