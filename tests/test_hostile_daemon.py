"""A hostile client of the socket daemon, in both modes (per-agent and batched): unknown verbs, malformed and
oversized lines, binary garbage, half-closed and dropped connections, many connections at once, impossible
budgets and model paths. Each gets an ``ERR`` line naming what was wrong; afterwards the agent admitted before
continues exactly as in a service nobody attacked, and its saved state is whole (CPU, tiny model)."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from kvrt.serve.client import Client
from kvrt.serve.daemon import Daemon
from kvrt.serve.protocol import MAX_LINE
from test_daemon import N_CTX, raw_exchange
from test_daemon_hardening import WAIT_S
from test_hostile_state import service

TURNS = ("a long time ago", "and then")
CONNECTIONS = 48


@pytest.fixture(params=["per-agent", "batched"])
def attacked(request, sock_dir, tmp_path, tiny_model_path) -> Iterator[tuple[Daemon, Path, str]]:
    """A daemon whose agent ``keep`` had its first turn; its state dir; the mode."""
    state = tmp_path / "state"
    sched = service(request.param, state)
    server = Daemon(sock_dir / "hostile.sock", sched).start()
    with Client(server.path, timeout=WAIT_S) as client:
        client.register("keep", tiny_model_path, N_CTX)
        client.decode("keep", TURNS[0], 4)
    yield server, state, request.param
    server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_path) -> dict[str, list[str]]:
    """Per mode, the texts of ``keep``'s turns in a service nobody attacked."""
    texts = {}
    for mode in ("per-agent", "batched"):
        with service(mode, tmp_path_factory.mktemp(mode)) as sched:
            sched.register("keep", tiny_model_path, N_CTX)
            texts[mode] = [sched.decode("keep", turn, 4).text for turn in TURNS]
    return texts


def err(reply: bytes) -> str:
    """The one ``ERR`` line of a whole reply."""
    lines = reply.decode().splitlines()
    assert lines[-1] == "END" and len(lines) == 2 and lines[0].startswith("ERR "), reply[:500]
    return lines[0]


def replied(reader: BinaryIO) -> bytes:
    """The next whole reply on a connection's reader (up to and including its ``END`` line)."""
    lines = []
    while not lines or lines[-1] != b"END\n":
        line = reader.readline()
        assert line, b"".join(lines)
        lines.append(line)
    return b"".join(lines)


def still_whole(server: Daemon, state: Path, mode: str, reference: dict[str, list[str]]) -> None:
    """``keep`` continues as in the reference, nothing is unsaved, and a new service reads it all back."""
    with Client(server.path, timeout=WAIT_S) as client:
        assert client.decode("keep", TURNS[1], 4).text == reference[mode][1]
        status = client.status()
    assert status["state_unsaved"] == "0" and status["state_skipped"] == "0"
    transcript = server.scheduler.transcript("keep")
    server.stop()
    with service(mode, state) as again:
        assert again.state_problems == [] and again.transcript("keep") == transcript


@pytest.mark.parametrize("line, code, named", [
    (b"FROB keep\n", "UNKNOWN_VERB", "FROB"),
    (b"DECODE keep lots hi\n", "BAD_NUMBER", "'lots'"),
    (b"DECODE keep 0 hi\n", "BAD_NUMBER", "0"),
    (b"REGISTER x /m.gguf 512 policy=evict\n", "BAD_ARGS", "evict"),
    (b"REGISTER bad/id /m.gguf\n", "BAD_ARGS", "bad/id"),
    (b"DECODE keep 3 \\q\n", "BAD_ARGS", "\\q"),
    (b"HELP \xc3\x28\n", "BAD_UTF8", "UTF-8"),
    (b"DECODE nobody 3 hi\n", "UNKNOWN_AGENT", "'nobody'"),
    (b"FORK nobody x\n", "UNKNOWN_AGENT", "'nobody'"),
    (b"REGISTER x /no/such/model.gguf 256\n", "MODEL_LOAD", "/no/such/model.gguf"),
    (b"DECODE keep 1000000 hi\n", "CONTEXT_FULL", f"n_ctx {N_CTX}"),
])
def test_bad_lines_are_named_and_cost_nothing(attacked, reference, line, code, named):
    server, state, mode = attacked
    reply = err(raw_exchange(server.path, line))
    assert reply.startswith(f"ERR {code} ") and named in reply, reply
    still_whole(server, state, mode, reference)


def test_impossible_budgets_are_refused_with_their_numbers(attacked, reference, tmp_path, tiny_model_path):
    server, state, mode = attacked
    huge = err(raw_exchange(server.path, b"REGISTER big %s 16000000\n" % str(tiny_model_path).encode()))
    if mode == "per-agent":
        assert huge.startswith("ERR VRAM_LEDGER_DENY ") and "request_table_bytes=" in huge, huge
    else:
        assert huge.startswith("ERR BAD_ARGS ") and "n_ctx 16000000 exceeds the 1024 cells" in huge, huge
    not_a_model = tmp_path / "text.gguf"
    not_a_model.write_text("hello")
    wrong = err(raw_exchange(server.path, b"REGISTER y %s 256\n" % str(not_a_model).encode()))
    assert wrong.startswith("ERR MODEL_LOAD ") and "text.gguf is not a GGUF file" in wrong, wrong
    still_whole(server, state, mode, reference)


def test_an_oversized_line_then_garbage_then_a_good_line_on_one_connection(attacked, reference):
    server, state, mode = attacked
    rng = random.Random(27)
    garbage = bytes(rng.randrange(256) for _ in range(4000)).replace(b"\n", b"") + b"\n"
    payload = b"x" * (MAX_LINE + 100) + b"\n" + garbage + b"\x00\xff\x00\n" + b"HELP\n"
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(WAIT_S)
        conn.connect(str(server.path))
        conn.sendall(payload)
        reader = conn.makefile("rb")
        replies = [replied(reader) for _ in range(4)]
    assert "LINE_TOO_LONG" in err(replies[0]) and str(MAX_LINE + 101) in err(replies[0])
    assert all(err(r).split()[1] in {"UNKNOWN_VERB", "BAD_UTF8", "BAD_ARGS", "EMPTY"} for r in replies[1:3])
    assert replies[3].startswith(b"OK schema=") and replies[3].endswith(b"END\n")
    still_whole(server, state, mode, reference)


def test_half_closed_and_dropped_connections(attacked, reference, tiny_model_path):
    server, state, mode = attacked
    with Client(server.path, timeout=WAIT_S) as client:
        client.register("other", tiny_model_path, N_CTX)
    whole = raw_exchange(server.path, b"DECODE other 3 hi there\n")  # written, then half-closed
    assert whole.startswith(b"OK schema=") and whole.endswith(b"END_RESPONSE\nEND\n")
    for _ in range(3):  # the client leaves before its reply: the turn still runs, and is saved
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(server.path))
            conn.sendall(b"DECODE other 3 stream=1 -- and gone\n")
    with socket.socket(socket.AF_UNIX) as conn:  # half a line, then gone
        conn.connect(str(server.path))
        conn.sendall(b"DECODE other 3 never fini")
    still_whole(server, state, mode, reference)


def test_many_connections_at_once_are_all_answered(attacked, reference):
    server, state, mode = attacked
    replies: list[bytes] = []
    lock = threading.Lock()

    def ask(line: bytes) -> None:
        reply = raw_exchange(server.path, line)
        with lock:
            replies.append(reply)

    lines = [b"STATUS\n", b"LIST\n", b"NOPE\n", b"\xff\n"] * (CONNECTIONS // 4)
    threads = [threading.Thread(target=ask, args=(line,)) for line in lines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert len(replies) == CONNECTIONS and all(r.endswith(b"END\n") for r in replies)
    assert sum(r.startswith(b"OK") for r in replies) == CONNECTIONS // 2
    still_whole(server, state, mode, reference)
