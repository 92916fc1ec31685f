"""The line protocol and a real daemon over a Unix socket (CPU llama.cpp, tiny models)."""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _serving import N_CTX
from kvrt.accounting.ledger import LedgerDenied, VramLedger
from kvrt.errors import InvalidArgument
from kvrt.runtime.requests import EngineClosed
from kvrt.serve.client import Client, ConnectionLost, DaemonReplyError
from kvrt.serve.daemon import Daemon, DaemonError, check_socket_path
from kvrt.serve.protocol import (
    MAX_LINE,
    DecodeOptions,
    ProtocolError,
    error_reply,
    escape_prompt,
    parse_fields,
    parse_line,
    unescape_prompt,
)
from kvrt.serve.results import ContextFull
from kvrt.serve.scheduler import Scheduler


# -- protocol, no sockets -------------------------------------------------------------------
@pytest.mark.parametrize("line, code", [
    (b"FOO\n", "UNKNOWN_VERB"),
    (b"\n", "EMPTY"),
    (b"   \n", "EMPTY"),
    (b"REGISTER a\n", "BAD_ARGS"),
    (b"REGISTER a b 12 extra\n", "BAD_ARGS"),
    (b"REGISTER a b -5\n", "BAD_NUMBER"),
    (b"REGISTER a b 0\n", "BAD_NUMBER"),
    (b"UNREGISTER\n", "BAD_ARGS"),
    (b"STATUS now\n", "BAD_ARGS"),
    (b"DECODE a\n", "BAD_ARGS"),
    (b"DECODE a 5\n", "BAD_ARGS"),
    (b"DECODE a 5    \n", "BAD_ARGS"),
    (b"DECODE a five hello\n", "BAD_NUMBER"),
    (b"DECODE a 0 hello\n", "BAD_NUMBER"),
    (b"DECODE a 99999999999999 hello\n", "BAD_NUMBER"),
    (b"DECODE a 3 bad \\q escape\n", "BAD_ARGS"),
    (b"REGISTER a /m.gguf 512 policy=evict\n", "BAD_ARGS"),
    (b"REGISTER a /m.gguf 512 colour=red\n", "BAD_ARGS"),
    (b"REGISTER a /m.gguf policy=grow policy=shift\n", "BAD_ARGS"),
    (b"REGISTER a /m.gguf 512 min_ctx=-1\n", "BAD_NUMBER"),
    (b"DECODE a 5 temperature=hot -- hi\n", "BAD_NUMBER"),
    (b"DECODE a 5 stream=yes -- hi\n", "BAD_ARGS"),
    (b"DECODE a 5 seed=1 seed=2 -- hi\n", "BAD_ARGS"),
    (b'DECODE a 5 stop="" -- hi\n', "BAD_ARGS"),
    (b"CANCEL\n", "BAD_ARGS"),
    (b"HELP \xff\xfe\n", "BAD_UTF8"),
    (b"HELP\x00\n", "BAD_ARGS"),
    (b"x" * (MAX_LINE + 10), "LINE_TOO_LONG"),
])
def test_malformed_lines_become_err_lines(line, code):
    with pytest.raises(ProtocolError) as info:
        parse_line(line)
    assert info.value.code == code
    assert info.value.reply().startswith(f"ERR {code} ") and "\n" not in info.value.reply()


def test_every_layers_refusal_maps_to_its_err_code():
    assert error_reply(LedgerDenied(owner="agent:a", max_bytes=10, allocated_bytes=8, request_bytes=5)) == (
        "ERR VRAM_LEDGER_DENY code=CAP ledger_max_bytes=10 ledger_allocated_bytes=8 request_table_bytes=5")
    assert error_reply(ContextFull("agent 'a' is full")).startswith("ERR CONTEXT_FULL agent 'a'")
    assert error_reply(EngineClosed("the engine was closed")).startswith("ERR SHUTTING_DOWN ")
    assert error_reply(InvalidArgument("top_p must be in (0, 1]")).startswith("ERR BAD_ARGS top_p")
    assert error_reply(RuntimeError("bug")) == "ERR INTERNAL RuntimeError: bug"


def test_well_formed_lines():
    assert parse_line(b"help\n").verb == "HELP"
    assert parse_line(b"REGISTER a /m.gguf\n").args == ("a", "/m.gguf", 4096, "refuse", None, None)
    assert parse_line(b"REGISTER a /m.gguf 512\r\n").args == ("a", "/m.gguf", 512, "refuse", None, None)
    assert parse_line(b"REGISTER a /m.gguf 2048 policy=grow min_ctx=300\n").args == (
        "a", "/m.gguf", 2048, "grow", 300, None)
    assert parse_line(b"REGISTER a /m.gguf keep=4 policy=shift\n").args == ("a", "/m.gguf", 4096, "shift", None, 4)
    assert parse_line(b"DECODE a 24  two  spaces\\nand a line\n").args == (
        "a", 24, " two  spaces\nand a line", DecodeOptions())
    options = DecodeOptions(temperature=0.7, top_k=5, seed=3, stop=("a b", "x"), deadline_ms=250, stream=True)
    assert parse_line(b'DECODE a 5 temperature=0.7 top_k=5 seed=3 stop="a b" stop=x deadline_ms=250 stream=1 '
                      b'-- hi -- there\n').args == ("a", 5, "hi -- there", options)
    assert parse_line(b"DECODE a 5 not=an option -- so all prompt\n").args[2:] == (
        "not=an option -- so all prompt", DecodeOptions())


@given(st.binary(max_size=300))
def test_parsing_arbitrary_bytes_only_ever_raises_protocol_errors(data):
    try:
        parse_line(data)
    except ProtocolError as exc:
        assert exc.reply().startswith("ERR ")


@given(st.text(max_size=200))
def test_prompt_escaping_round_trips(text):
    expected = text.replace("\r\n", "\n").replace("\r", "\n")
    assert unescape_prompt(escape_prompt(expected)) == expected
    assert "\n" not in escape_prompt(text)


def test_fields_survive_quotes():
    assert parse_fields('OK model="a b" n=3 note="x\\"y"') == {"model": "a b", "n": "3", "note": 'x"y'}


# -- a real daemon ------------------------------------------------------------------------------
def raw_exchange(path: Path, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_socket_is_owner_only(daemon):
    assert stat.S_IMODE(daemon.path.stat().st_mode) == 0o600


def test_session_register_decode_swap_and_deny(daemon, tiny_model_path, other_tiny_model_path):
    with Client(daemon.path) as client:
        assert client.register("a", tiny_model_path, N_CTX)["estimate"] == "derived"
        client.register("b", other_tiny_model_path, N_CTX)
        first = client.decode("a", "Hello, my name is", 8)
        assert first.fields["kv_swap_evicted"] == "none" and not first.restored
        assert first.fields["generated_tokens"] == "8" and len(first.text) > 0
        client.decode("b", "The capital", 8)
        again = client.decode("a", "The weather\ntoday", 8)
        assert again.evicted == ["b"] and again.restored  # lmxd's third call: qwen evicted, smol restored
        with pytest.raises(DaemonReplyError) as info:
            client.register("c", tiny_model_path, 1 << 16)
        assert info.value.code == "VRAM_LEDGER_DENY"
        assert info.value.line.startswith("ERR VRAM_LEDGER_DENY code=CAP ledger_max_bytes=")
        assert {"ledger_max_bytes", "ledger_allocated_bytes", "request_table_bytes"} <= set(info.value.fields)
        status = client.status()
        assert status["agents"] == "2" and len(status["loaded"]) == 2
        assert [a["agent"] for a in client.list()] == ["a", "b"]
        metrics = client.metrics()
        assert metrics["requests"] == "3" and float(metrics["latency_p99_ms"]) >= float(metrics["latency_p50_ms"])
        forked = client.fork("a", "a2")
        assert int(forked["held_tokens"]) > 0
        client.unregister("a2")


def test_bad_clients_get_err_lines_and_others_keep_their_state(daemon, tiny_model_path):
    with Client(daemon.path) as good:
        good.register("keep", tiny_model_path, N_CTX)
        before = good.decode("keep", "remember this", 4)
        replies = raw_exchange(daemon.path, b"NOPE\nDECODE keep x hi\nREGISTER only\n\xff\xfe\n"
                               + b"y" * (MAX_LINE + 5) + b"\nHELP\n").decode("utf-8", "replace")
        errs = [line.split()[1] for line in replies.splitlines() if line.startswith("ERR ")]
        assert errs == ["UNKNOWN_VERB", "BAD_NUMBER", "BAD_ARGS", "BAD_UTF8", "LINE_TOO_LONG"]
        assert "OK schema=" in replies  # HELP after all that is still answered
        raw_exchange(daemon.path, b"DECODE keep 4 cut off mid-requ")  # disconnects without a newline
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as quitter:  # leaves before its reply
            quitter.connect(str(daemon.path))
            quitter.sendall(b"DECODE keep 2 and gone\n")
        after = good.decode("keep", "and more", 4)
        assert after.fields["kv_swap_evicted"] == "none" and before.text is not None
        assert [a["agent"] for a in good.list()] == ["keep"]


def test_refused_registrations_name_the_problem(daemon, tiny_model_path, sock_dir):
    with Client(daemon.path) as client:
        for line, code in [(f"REGISTER a {sock_dir}/missing.gguf", "MODEL_LOAD"),
                           (f"REGISTER bad/id {tiny_model_path}", "BAD_ARGS"),
                           ("UNREGISTER ghost", "UNKNOWN_AGENT"), ("FORK ghost b", "UNKNOWN_AGENT"),
                           ("METRICS ghost", "UNKNOWN_AGENT")]:
            with pytest.raises(DaemonReplyError) as info:
                client.request(line)
            assert info.value.code == code, line
        client.register("a", tiny_model_path, N_CTX)
        with pytest.raises(DaemonReplyError, match="AGENT_EXISTS"):
            client.register("a", tiny_model_path, N_CTX)
        with pytest.raises(DaemonReplyError, match="exceeds"):  # prompt + n_tokens past the context
            client.decode("a", "x", 100_000)
        assert client.status()["ledger_allocated_bytes"] != "0"


def test_many_clients_at_once(daemon, tiny_model_path):
    with Client(daemon.path) as setup:
        for i in range(4):
            setup.register(f"agent{i}", tiny_model_path, N_CTX)
    errors: list[BaseException] = []
    results: dict[str, list[str]] = {}

    def agent(i: int) -> None:
        try:
            with Client(daemon.path) as client:
                results[f"agent{i}"] = [client.decode(f"agent{i}", f"turn {t}", 4).text for t in range(3)]
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results) == [f"agent{i}" for i in range(4)]
    assert len({tuple(v) for v in results.values()}) == 1  # same model, same turns: same text for all


def test_socket_path_checks(sock_dir, tmp_path):
    target = sock_dir / "stale.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(target))
    stale.close()  # bound, never listening: what a crashed daemon leaves behind
    assert check_socket_path(target) == target and not target.exists()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(target))
    live.listen()
    try:
        with pytest.raises(DaemonError, match="already serving"):
            check_socket_path(target)
    finally:
        live.close()
        target.unlink()
    plain = sock_dir / "file"
    plain.write_text("x")
    with pytest.raises(DaemonError, match="not a socket"):
        check_socket_path(plain)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(DaemonError, match="writable by others"):
        check_socket_path(open_dir / "s.sock")
    with pytest.raises(DaemonError, match="does not exist"):
        check_socket_path(tmp_path / "missing" / "s.sock")


def test_sigterm_shuts_down_cleanly(sock_dir, tiny_model_path):
    path = sock_dir / "term.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvrt.cli", "serve", "--socket", str(path),
                             "--capacity-bytes", str(1 << 30), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "listening on" in proc.stdout.readline()
        with Client(path) as client:
            client.register("a", tiny_model_path, N_CTX)
            client.decode("a", "hello", 2)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            with pytest.raises((ConnectionLost, OSError)):
                client.decode("a", "after shutdown", 2)
        assert not path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def queue_behind(path: Path, scheduler: Scheduler, replies: list[str], *,
                 timeout: float | None = None) -> threading.Thread:
    """A client thread whose DECODE of agent ``a`` waits in ``scheduler``'s queue (returned once it is queued);
    its reply code goes into ``replies`` ("OK" or the ERR code); ``timeout`` bounds the client's wait."""
    def queued() -> None:
        with Client(path, timeout=timeout) as client:
            try:
                client.decode("a", "queued behind", 2)
                replies.append("OK")
            except DaemonReplyError as exc:
                replies.append(exc.code)

    waiter = threading.Thread(target=queued)
    waiter.start()
    while not scheduler.agents()[0].queued:
        threading.Event().wait(0.001)
    return waiter


def held_daemon(path: Path, model_path: Path) -> tuple[Scheduler, Daemon, threading.Event, threading.Thread]:
    """A started daemon on ``path`` with agent ``a`` registered and its scheduler's worker held by a job that
    runs until the returned event is set (then join the returned thread)."""
    from test_scheduler import hold_worker

    scheduler = Scheduler(VramLedger(1 << 30), n_threads=1)
    server = Daemon(path, scheduler).start()
    with Client(server.path) as setup:
        setup.register("a", model_path, N_CTX)
    gate, holder = hold_worker(scheduler)
    return scheduler, server, gate, holder


def test_stop_finishes_the_running_request_and_refuses_queued_ones(sock_dir, tiny_model_path):
    # the held job stands for the request running when SIGTERM arrives
    scheduler, server, gate, holder = held_daemon(sock_dir / "stop.sock", tiny_model_path)
    replies: list[str] = []
    waiter = queue_behind(server.path, scheduler, replies)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    while not scheduler._closing:  # SIGTERM's path has reached the scheduler
        threading.Event().wait(0.001)
    gate.set()  # the running job completes normally; the queued one must not start
    for thread in (holder, waiter, stopper):
        thread.join()
    assert replies == ["SHUTTING_DOWN"] and not server.path.exists()
