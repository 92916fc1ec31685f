"""``kvrt serve --socket PATH --http HOST:PORT``: one process, one ledger and one model registry under both fronts.

A model both fronts use is loaded and charged once (the registry's refcount counts the HTTP
front's lease and every socket agent's), the HTTP engine's context is on the ledger the socket's
agents are admitted to, both answer at once, and SIGTERM stops both with status 0. A model the
ledger cannot hold is refused at start with the ledger's numbers. A ``--models-dir`` model the HTTP front
loads on demand and unloads again keeps its weights while a socket agent leases them.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from _serving import http_call, serving
from kvrt.serve.client import Client

pytest.importorskip("fastapi", reason="the serve extra is not installed")
WAIT_S = 120.0
KVRT = [sys.executable, "-m", "kvrt.cli"]
ENV = {**os.environ, "KVRT_EXTRA_BUFTS": "off"}


@pytest.fixture()
def both(tmp_path: Path, tiny_model_path: Path) -> Iterator[tuple[subprocess.Popen, Path, str]]:
    """The process with both fronts on the tiny model; yields it, its socket and its HTTP address."""
    sock = tmp_path / "kvrt.sock"
    with serving([*KVRT, "serve", "--socket", str(sock), "--http", "127.0.0.1:0", "--model", str(tiny_model_path),
                  "--n-ctx", "1024", "--slots", "2", "--threads", "1", "--capacity-bytes", str(4 << 30),
                  "--charge", "estimated"], ENV) as (proc, address, _):
        yield proc, sock, address


def _completion(address: str, model: str, prompt: list[int]) -> dict:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()[:500]
    reply = json.loads(response.read())
    connection.close()
    return reply


def _model_line(status: dict) -> dict:
    (line,) = status["loaded"]
    return line


def test_one_process_serves_both_fronts_on_one_ledger(both, tiny_model_path: Path):
    proc, sock, address = both
    with Client(sock) as client:
        before = client.status()
        assert before["models"] == "1" and _model_line(before)["refcount"] == "1"  # the HTTP front's lease
        weights = int(_model_line(before)["reserved_bytes"])
        http_context = int(before["ledger_allocated_bytes"]) - weights
        assert http_context > 0  # the HTTP engine's cells are charged to the ledger the socket admits against
        client.register("a", tiny_model_path, 512)
        decoded = client.decode("a", "Hello, my name is", 6)
        assert decoded.fields["generated_tokens"] == "6"
        after = client.status()
        assert after["models"] == "1" and _model_line(after)["refcount"] == "2"  # loaded once, shared
        assert int(_model_line(after)["reserved_bytes"]) == weights
        (agent,) = client.list()
        assert agent["state"] == "active" and int(agent["context_bytes"]) > 0
        # one ledger: the weights once, the HTTP engine's context and the agent's, nothing else
        assert int(after["ledger_allocated_bytes"]) == weights + http_context + int(agent["context_bytes"])
        reply = _completion(address, tiny_model_path.stem, [1, 2, 3, 4])
        assert reply["usage"]["completion_tokens"] == 6
        assert client.decode("a", " and then", 4).fields["generated_tokens"] == "4"  # the socket still serves
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 0, proc.stderr.read()[-2000:] if proc.stderr else ""
    assert not sock.exists()


def test_a_model_the_ledger_cannot_hold_is_refused_with_its_numbers(tmp_path: Path, tiny_model_path: Path):
    done = subprocess.run([*KVRT, "serve", "--socket", str(tmp_path / "kvrt.sock"), "--http", "127.0.0.1:0",
                           "--model", str(tiny_model_path), "--threads", "1", "--capacity-bytes", "4096",
                           "--charge", "estimated"], capture_output=True, text=True, timeout=WAIT_S, env=ENV)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr  # the CLI's status for a refusal
    # the weights and the engine's context are admitted together, before either is allocated
    assert f"VRAM ledger denied http:{tiny_model_path.stem} (weights " in done.stderr, done.stderr
    assert "of max 4096 B" in done.stderr, done.stderr
    assert not (tmp_path / "kvrt.sock").exists()  # the socket front that had started is gone again


def test_an_http_unload_never_frees_a_socket_agents_model(tmp_path: Path, tiny_model_path: Path,
                                                          other_tiny_model_path: Path):
    """--models-dir beside --socket: the HTTP front loads a model on demand that a socket agent also uses (one
    registry entry, two leases), then unloads it; the agent's weights stay loaded and charged, and it decodes on."""
    models = tmp_path / "models"
    models.mkdir()
    for path in (tiny_model_path, other_tiny_model_path):
        shutil.copyfile(path, models / path.name)
    shared = models / tiny_model_path.name
    sock = tmp_path / "kvrt.sock"
    with serving([*KVRT, "serve", "--socket", str(sock), "--http", "127.0.0.1:0", "--models-dir", str(models),
                  "--n-ctx", "1024", "--slots", "2", "--threads", "1", "--capacity-bytes", str(4 << 30),
                  "--charge", "estimated"], ENV) as (proc, address, printed):
        assert "on demand: tiny, tiny-seed1" in printed, printed
        with Client(sock) as client:
            client.register("a", shared, 512)
            assert client.decode("a", "Hello, my name is", 4).fields["generated_tokens"] == "4"
            assert _completion(address, "tiny", [1, 2, 3, 4])["usage"]["completion_tokens"] == 6  # loaded now
            assert _model_line(client.status())["refcount"] == "2"  # the agent's lease and the HTTP front's
            status, card = http_call(address, "POST", "/v1/kvrt/models/tiny/unload")
            assert status == 200 and card["unloaded"] and not card["loaded"], card
            after = client.status()
            assert after["models"] == "1" and _model_line(after)["refcount"] == "1"  # the agent's lease is left
            owners = http_call(address, "GET", "/v1/kvrt/stats")[1]["kvrt:ledger"]["by_owner"]
            assert "http:tiny" not in owners and f"model:{shared.name}" in owners, owners
            assert client.decode("a", " and then", 4).fields["generated_tokens"] == "4"  # its weights are alive
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0, proc.stderr.read()[-2000:] if proc.stderr else ""
