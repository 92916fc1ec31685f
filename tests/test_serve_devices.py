"""``kvrt serve --devices``: two emulated devices, two models, both fronts, one process.

Each ``--model`` is placed by free memory after its weights (a ``--vram-table`` makes them exact) and its engine's
context, loaded with that device's ``main_gpu`` and charged to that device's ledger; ``/v1/kvrt/stats`` shows each
device's ledger and where each model is, the socket's STATUS one line per device, and a socket agent (``--batch-slots``)
on a model the HTTP front placed charges its batch context to that model's device. A model no device (nor all of them)
can hold is refused at start naming every device's numbers; a bad SPEC and the per-agent socket front are refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from _serving import http_call, serving
from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.modelfiles.testmodels import write_model
from kvrt.runtime.admission import EngineConfig
from kvrt.serve.client import Client

pytest.importorskip("fastapi", reason="the serve extra is not installed")
WAIT_S = 120.0
KVRT = [sys.executable, "-m", "kvrt.cli"]
ENV = {**os.environ, "KVRT_EXTRA_BUFTS": "off"}
WEIGHTS = 1 << 20
N_CTX = 512


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Models ``a`` and ``b`` (different weights) and a VRAM table charging each ``WEIGHTS``."""
    folder = tmp_path_factory.mktemp("devices-e2e")
    a, b = write_model(folder / "a.gguf", "tiny", seed=0), write_model(folder / "b.gguf", "tiny", seed=1)
    table = folder / "vram.table"
    table.write_text(f"a.gguf {WEIGHTS}\nb.gguf {WEIGHTS}\n")
    return a, b, table


def http_context_bytes(model: Path) -> int:
    """The context estimate the HTTP front charges per model with the flags below (--n-ctx 512)."""
    return context_estimate(ModelShape.read(model), N_CTX, EngineConfig(n_ctx=N_CTX).n_ubatch).total_bytes


def serve(*args: str) -> list[str]:
    return [*KVRT, "serve", "--n-ctx", str(N_CTX), "--slots", "2", "--threads", "1", "--host-mib", "0",
            "--charge", "estimated", *args]


@pytest.fixture()
def on_two_devices(tmp_path: Path, two_models) -> Iterator[tuple[subprocess.Popen[str], Path, str, int]]:
    """Both fronts over two emulated devices of four models' room each; yields the process, its socket, its HTTP
    address and one device's capacity."""
    a, b, table = two_models
    room = WEIGHTS + http_context_bytes(a)
    capacity = 4 * room
    sock = tmp_path / "kvrt.sock"
    with serving(serve("--socket", str(sock), "--batch-slots", "2", "--batch-cells", "512", "--http", "127.0.0.1:0",
                       "--model", str(a), "--model", str(b), "--vram-table", str(table),
                       "--devices", f"0:{capacity},1:{capacity}"), ENV) as (proc, address, first):
        assert f"device 0 max {capacity} B, device 1 max {capacity} B" in first
        yield proc, sock, address, capacity


def test_two_models_on_two_devices_each_charged_to_its_own(on_two_devices, two_models):
    proc, sock, address, capacity = on_two_devices
    a, b, _ = two_models
    context = http_context_bytes(a)
    status, stats = http_call(address, "GET", "/v1/kvrt/stats")
    assert status == 200
    ledger = stats["kvrt:ledger"]
    assert ledger["placements"] == {"a": "device 0", "b": "device 1"}  # a: equal room, lowest index; b: more room
    assert ledger["devices"]["0"]["by_owner"] == {"model:a.gguf": WEIGHTS, "http:a": context}
    assert ledger["devices"]["1"]["by_owner"] == {"model:b.gguf": WEIGHTS, "http:b": context}
    assert ledger["devices"]["1"]["capacity_bytes"] == capacity
    for model in ("a", "b"):
        status, reply = http_call(address, "POST", "/v1/completions",
                             {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0})
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    with Client(sock) as client:
        client.register("ada", b, 256)  # the socket's agent shares b where the HTTP front placed it
        assert client.decode("ada", "Hello", 3).fields["generated_tokens"] == "3"
        after = client.status()
        placed = {line["model"]: line["placement"] for line in after["loaded"]}
        assert placed == {"a.gguf": "device 0", "b.gguf": "device 1"}
        devices = {line["device"]: int(line["ledger_allocated_bytes"]) for line in after["devices"]}
        assert devices["0"] == WEIGHTS + context
        assert devices["1"] > WEIGHTS + context  # b's batch context went where b is
    _, stats = http_call(address, "GET", "/v1/kvrt/stats")
    assert set(stats["kvrt:ledger"]["devices"]["1"]["by_owner"]) == {"model:b.gguf", "http:b", "batch:b.gguf"}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 0, proc.stderr.read()[-2000:] if proc.stderr else ""


def test_a_model_no_device_can_hold_is_refused_at_start_naming_every_device(tmp_path: Path, two_models):
    a, _, table = two_models
    done = subprocess.run(serve("--http", "127.0.0.1:0", "--model", str(a), "--vram-table", str(table),
                                "--devices", "2x600KiB"), capture_output=True, text=True, timeout=WAIT_S, env=ENV)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "no device can take http:a (weights 1048576 B + context" in done.stderr, done.stderr
    assert "device 0: 614400 B free of max 614400 B (0 B allocated)" in done.stderr, done.stderr
    assert "device 1: 614400 B free of max 614400 B (0 B allocated)" in done.stderr, done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("--http", "127.0.0.1:0", "--devices", "0:1GiB,0:2GiB"), "device 0 is given twice"),
    (("--http", "127.0.0.1:0", "--devices", "0:1GiB", "--capacity-bytes", "100"), "drop --capacity-bytes"),
    (("--socket", "SOCK", "--devices", "0:1GiB"), "--devices with --socket needs --batch-slots"),
    (("--http", "127.0.0.1:0", "--replicas", "2"), "--replicas 2 needs --devices"),
])
def test_bad_device_options_are_refused(tmp_path: Path, args, message):
    args = tuple(str(tmp_path / "kvrt.sock") if a == "SOCK" else a for a in args)
    done = subprocess.run(serve(*args), capture_output=True, text=True, timeout=WAIT_S, env=ENV)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_help_documents_the_spec():
    done = subprocess.run([*KVRT, "serve", "--help"], capture_output=True, text=True, timeout=WAIT_S, env=ENV)
    assert "--devices SPEC" in done.stdout and "COUNTxSIZE" in " ".join(done.stdout.split())


def test_replicas_put_a_copy_of_each_model_on_each_device(two_models):
    a, _, table = two_models
    room = WEIGHTS + http_context_bytes(a)
    with serving(serve("--http", "127.0.0.1:0", "--model", str(a), "--vram-table", str(table),
                       "--devices", f"2x{2 * room}", "--replicas", "2"), ENV) as (proc, address, _):
        _, stats = http_call(address, "GET", "/v1/kvrt/stats")
        ledger = stats["kvrt:ledger"]
        assert ledger["placements"] == {"a": "device 0 + device 1"}
        assert set(ledger["devices"]["1"]["by_owner"]) == {"model:a.gguf@1", "http:a@1"}
        for agent in ("ada", "bob", "ada"):
            status, _ = http_call(address, "POST", "/v1/completions", {"model": "a", "prompt": [1, 2, 3, 4],
                                                                       "max_tokens": 3, "temperature": 0},
                                  {"X-Kvrt-Agent": agent})
            assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0, proc.stderr.read()[-2000:] if proc.stderr else ""
