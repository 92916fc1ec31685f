"""The daemon under pressure: signals while clients churn, odd model paths, connection floods, idle
clients, restarts with saved agents, and the exact request-line limit (CPU llama.cpp, tiny models)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrt.accounting.estimate import EstimateError, ModelShape, context_estimate
from kvrt.accounting.ledger import VramLedger
from kvrt.modelfiles.testmodels import write_model
from kvrt.serve.client import Client, DaemonReplyError
from kvrt.serve.daemon import Daemon
from kvrt.serve.protocol import MAX_LINE, ProtocolError, parse_line
from kvrt.serve.scheduler import Scheduler
from test_daemon import N_CTX, held_daemon, queue_behind, raw_exchange

WAIT_S = 30.0  # bound on every wait below, so a regression fails instead of hanging


def one_context_capacity(model: Path) -> int:
    """Ledger bytes for two such models' weights plus exactly one live context of N_CTX cells (the daemon fixture's)."""
    shape = ModelShape.read(model)
    return 2 * shape.weight_bytes(on_gpu=False) + context_estimate(shape, N_CTX).total_bytes


@contextlib.contextmanager
def serving(path: Path, log: Path, *options: str) -> Iterator[subprocess.Popen[str]]:
    """A real ``kvrt serve`` subprocess on ``path`` (stderr to ``log``), killed if a test leaves it running."""
    with log.open("a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvrt.cli", "serve", "--socket", str(path), "--threads", "1",
                                 *options], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        banner = proc.stdout.readline() if proc.stdout else ""
        assert "listening on" in banner, banner + log.read_text()
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def read_reply(sock: socket.socket) -> bytes:
    """Bytes up to and including a reply's ``END`` line, or whatever came before the daemon closed."""
    data = b""
    while not data.endswith(b"END\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


# -- 1. SIGTERM while clients connect and disconnect -----------------------------------------------
def test_sigterm_always_ends_the_daemon_while_clients_come_and_go(sock_dir, tmp_path):
    def churn(path: Path, stop: threading.Event, done: threading.Semaphore) -> None:
        """HELP on a new connection to ``path``, again and again until ``stop``; ``done`` counts the answers."""
        while not stop.is_set():
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(WAIT_S)
                    s.connect(str(path))
                    s.sendall(b"HELP\n")
                    read_reply(s)
            except OSError:
                return  # the daemon has gone
            done.release()

    for run in range(4):  # the lost signal showed in about half the runs
        path = sock_dir / f"churn{run}.sock"
        with serving(path, tmp_path / "serve.log", "--capacity-bytes", str(1 << 30)) as proc:
            done = threading.Semaphore(0)
            stop = threading.Event()
            threads = [threading.Thread(target=churn, args=(path, stop, done)) for _ in range(4)]
            for t in threads:
                t.start()
            for _ in range(40):
                assert done.acquire(timeout=WAIT_S)
            proc.send_signal(signal.SIGTERM)
            try:
                assert proc.wait(timeout=WAIT_S) == 0
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert not path.exists()


# -- 2. a FIFO (or any non-regular file) as a model path -------------------------------------------
def test_a_fifo_model_is_refused_and_later_requests_still_run(daemon, sock_dir, tiny_model_path):
    fifo = sock_dir / "model.gguf"
    os.mkfifo(fifo)
    try:
        with Client(daemon.path, timeout=WAIT_S) as client:
            with pytest.raises(DaemonReplyError) as info:
                client.register("f", fifo, 512)
            assert info.value.code == "MODEL_LOAD" and "not a regular file" in info.value.line
            with pytest.raises(DaemonReplyError, match="not a regular file"):
                client.register("d", "/dev/null", 512)
            client.register("a", tiny_model_path, N_CTX)
            assert client.decode("a", "still served", 2).fields["generated_tokens"] == "2"
    finally:
        with contextlib.suppress(OSError):  # a reader blocked in open() (the bug) is released, so teardown ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_header_reader_refuses_non_regular_files(sock_dir):
    fifo = sock_dir / "header.gguf"
    os.mkfifo(fifo)
    try:
        with pytest.raises(EstimateError, match="not a regular file.*FIFO"):
            ModelShape.read(fifo)
        with pytest.raises(EstimateError, match="not a regular file.*directory"):
            ModelShape.read(sock_dir)
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_stop_is_bounded_even_when_the_running_request_never_ends(sock_dir, tiny_model_path):
    # the held job: a request that does not finish by itself
    scheduler, server, gate, holder = held_daemon(sock_dir / "stuck.sock", tiny_model_path)
    try:
        replies: list[str] = []
        waiter = queue_behind(server.path, scheduler, replies, timeout=WAIT_S)
        outcome: list[bool] = []
        stopper = threading.Thread(target=lambda: outcome.append(server.stop(timeout=0.5)))
        stopper.start()
        stopper.join(WAIT_S)
        waiter.join(WAIT_S)
        assert outcome == [False]  # it did not wait for the stuck request: an unclean stop, said so
        assert replies == ["SHUTTING_DOWN"] and not server.path.exists()
    finally:
        gate.set()
        holder.join()


def long_request(client: Client, path: Path, tiny_model_path: Path) -> socket.socket:
    """A connection whose DECODE of up to 65,000 tokens is running (the agent's context exists): minutes of
    CPU decoding, unless the tiny random model picks its end-of-generation token first (other kernels, as on
    a GPU, can take it there)."""
    client.register("long", tiny_model_path, 65536)
    runner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    runner.connect(str(path))
    runner.sendall(b"DECODE long 65000 a very long answer\n")
    while client.list()[0]["state"] != "active":
        threading.Event().wait(0.01)
    return runner


def answered(runner: socket.socket) -> bool:
    """Whether the daemon has already replied on ``runner`` (its request is over)."""
    return bool(select.select([runner], [], [], 0)[0])


def test_sigterm_with_a_long_request_running_ends_within_the_shutdown_timeout(sock_dir, tmp_path, tiny_model_path):
    path = sock_dir / "long.sock"
    with serving(path, tmp_path / "serve.log", "--capacity-bytes", str(1 << 30), "--shutdown-timeout-s", "1") as proc:
        with Client(path, timeout=WAIT_S) as client:
            runner = long_request(client, path, tiny_model_path)
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(timeout=WAIT_S)  # bounded either way
            reply = read_reply(runner)
            runner.close()
    # 1: the request still ran at the timeout and was abandoned, unanswered; 0: it ended by itself first, answered
    assert (status, reply.startswith(b"OK")) in {(1, False), (0, True)}, (status, reply[:200])
    assert not path.exists()


def test_a_second_sigterm_ends_a_slow_shutdown_at_once(sock_dir, tmp_path, tiny_model_path):
    path = sock_dir / "second.sock"
    with serving(path, tmp_path / "serve.log", "--capacity-bytes", str(1 << 30), "--shutdown-timeout-s", "600") as proc:
        with Client(path, timeout=WAIT_S) as client:
            runner = long_request(client, path, tiny_model_path)
            if answered(runner):
                pytest.skip("the tiny model ended the long request by itself (end of generation): no slow shutdown")
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=0.5)  # the first one waits for the running request
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=WAIT_S) == 1
            runner.close()
    assert not path.exists()


# -- 3. many clients connecting at once -------------------------------------------------------------
def test_fifty_clients_connecting_at_once_all_get_in(daemon):
    barrier = threading.Barrier(50)
    failures: list[BaseException] = []
    answered: list[int] = []

    def connect() -> None:
        barrier.wait()
        try:
            with Client(daemon.path, timeout=WAIT_S) as client:
                answered.append(len(client.help()))
        except BaseException as exc:  # noqa: BLE001 - counted below
            failures.append(exc)

    threads = [threading.Thread(target=connect) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and len(answered) == 50


# -- 4. bounded connections and idle time ---------------------------------------------------------------
@pytest.fixture()
def small_daemon(sock_dir):
    server = Daemon(sock_dir / "small.sock", Scheduler(VramLedger(1 << 30), n_threads=1),
                    max_connections=3, idle_timeout_s=0.5).start()
    yield server
    server.stop()


def test_connections_past_the_limit_are_told_why_and_closed(small_daemon):
    clients = [Client(small_daemon.path, timeout=WAIT_S) for _ in range(3)]
    try:
        for client in clients:
            client.help()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
            extra.settimeout(WAIT_S)
            extra.connect(str(small_daemon.path))
            refusal = read_reply(extra)
            assert refusal.startswith(b"ERR TOO_MANY_CONNECTIONS max_connections=3 ")
            assert refusal.endswith(b"\nEND\n") and extra.recv(1) == b""
        with Client(small_daemon.path, timeout=WAIT_S) as refused, pytest.raises(DaemonReplyError) as info:
            refused.help()
        assert info.value.code == "TOO_MANY_CONNECTIONS" and info.value.fields["max_connections"] == "3"
        clients.pop().close()
        for _ in range(int(WAIT_S / 0.01)):  # the daemon notices the close on its own thread
            try:
                with Client(small_daemon.path, timeout=WAIT_S) as again:
                    assert again.help()
                break
            except DaemonReplyError:
                threading.Event().wait(0.01)
        else:
            pytest.fail("a freed connection slot was never given to a new client")
    finally:
        for client in clients:
            client.close()


def test_idle_connections_are_told_and_closed(small_daemon):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.settimeout(WAIT_S)
        idle.connect(str(small_daemon.path))
        idle.sendall(b"HELP\n")
        assert read_reply(idle).startswith(b"OK schema=")
        notice = read_reply(idle)  # nothing sent: the daemon speaks first, then closes
        assert notice.startswith(b"ERR IDLE_TIMEOUT idle_timeout_s=0.5 ") and notice.endswith(b"\nEND\n")
        assert idle.recv(1) == b""
    with Client(small_daemon.path, timeout=WAIT_S) as client:
        client.help()
        threading.Event().wait(1.5)  # past the idle timeout: the next request learns why it was closed
        with pytest.raises(DaemonReplyError) as info:
            client.help()
        assert info.value.code == "IDLE_TIMEOUT"


def test_idle_clients_do_not_pile_up_threads(small_daemon):
    before = threading.active_count()
    sockets = []
    try:
        for _ in range(12):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(small_daemon.path))
            sockets.append(s)
        with Client(small_daemon.path, timeout=WAIT_S) as probe, contextlib.suppress(DaemonReplyError):
            probe.help()  # a round trip through the accept loop: the twelve have been seen
        assert threading.active_count() <= before + 3
    finally:
        for s in sockets:
            s.close()


# -- 6. the request-line limit, exactly -------------------------------------------------------------------
def test_max_line_counts_the_newline():
    fits = b"HELP" + b" " * (MAX_LINE - 5) + b"\n"
    assert len(fits) == MAX_LINE and parse_line(fits).verb == "HELP"
    assert parse_line(fits[:-1]).verb == "HELP"  # the same line without its newline
    for too_long in (fits[:-1] + b" \n", fits[:-1] + b" "):
        with pytest.raises(ProtocolError) as info:
            parse_line(too_long)
        assert info.value.code == "LINE_TOO_LONG" and f"{MAX_LINE + 1} bytes" in str(info.value)


def test_daemon_enforces_max_line_at_the_exact_boundary(daemon):
    fits = b"HELP" + b" " * (MAX_LINE - 5) + b"\n"
    over = fits[:-1] + b" \n"
    replies = raw_exchange(daemon.path, fits + over + b"HELP\n").decode()
    first, second, third = replies.split("\nEND\n")[:3]
    assert first.startswith("OK schema=")
    assert second.startswith("ERR LINE_TOO_LONG ") and f"{MAX_LINE + 1} bytes" in second
    assert third.startswith("OK schema=")


# -- 5. agents survive a restart --------------------------------------------------------------------------
TURNS = [("a", "Hello, my name is"), ("b", "The capital"), ("a", "and then\nwe"), ("b", "of France is")]


def register_both(client: Client, model_a: Path, model_b: Path) -> None:
    client.register("a", model_a, N_CTX)
    client.register("b", model_b, N_CTX)


def test_agents_survive_a_restart_and_continue_token_identically(sock_dir, tmp_path, tiny_model_path,
                                                                 other_tiny_model_path):
    # one live context, so a swaps out; sized from the estimates, which a GPU's daemon then charges too
    capacity = ("--capacity-bytes", str(one_context_capacity(tiny_model_path)), "--charge", "estimated")
    state, log = tmp_path / "state", tmp_path / "serve.log"
    path = sock_dir / "restart.sock"
    with serving(path, log, *capacity, "--state-dir", str(state)) as proc:
        with Client(path, timeout=WAIT_S) as client:
            register_both(client, tiny_model_path, other_tiny_model_path)
            for agent, prompt in TURNS[:2]:
                client.decode(agent, prompt, 6)
            before = {row["agent"]: row for row in client.list()}
            assert before["a"]["state"] == "swapped" and before["b"]["state"] == "active"
            assert (state / "a.agent.json").exists()  # written at the swap-out, before any SIGTERM
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    with serving(path, log, *capacity, "--state-dir", str(state)) as proc:
        with Client(path, timeout=WAIT_S) as client:
            after = {row["agent"]: row for row in client.list()}
            assert {a: row["state"] for a, row in after.items()} == {"a": "swapped", "b": "swapped"}
            assert after["a"]["held_tokens"] == before["a"]["held_tokens"] != "0"
            restarted = [client.decode(agent, prompt, 6) for agent, prompt in TURNS[2:]]
            assert client.status()["state_restored"] == "2"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    with serving(sock_dir / "never.sock", log, *capacity) as proc:  # the same turns, never restarted
        with Client(sock_dir / "never.sock", timeout=WAIT_S) as client:
            register_both(client, tiny_model_path, other_tiny_model_path)
            continuous = [client.decode(agent, prompt, 6) for agent, prompt in TURNS]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    assert [d.text for d in restarted] == [d.text for d in continuous[2:]]
    assert [d.fields["prompt_tokens"] for d in restarted] == [d.fields["prompt_tokens"] for d in continuous[2:]]
    assert all(d.restored for d in restarted)


def test_bad_state_files_are_reported_and_skipped_and_the_rest_restored(sock_dir, tmp_path, tiny_model_path):
    replaced = write_model(tmp_path / "replaced.gguf", "tiny", seed=0)
    state = tmp_path / "state"
    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state) as sched:
        for name in ("good", "flipped", "garbled", "changed", "empty"):
            sched.register(name, replaced if name == "changed" else tiny_model_path, N_CTX)
            if name != "empty":
                sched.decode(name, f"the text of {name}", 3)
        held = {a.agent_id: a for a in sched.agents()}
    # close() saved all five
    snapshot_file = next(state.glob("flipped+*.kvs"))
    data = bytearray(snapshot_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snapshot_file.write_bytes(bytes(data))
    (state / "garbled.agent.json").write_text('{"record": {"agent_id": "garbled"}, "checksum": "00"}')
    write_model(replaced, "tiny", seed=1)  # same path, other weights: its saved KV no longer fits it
    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state) as sched:
        agents = {a.agent_id: a for a in sched.agents()}
        assert set(agents) == {"good", "empty"}
        assert agents["good"].state == "swapped" and agents["empty"].state == "cold"
        assert agents["good"].held_tokens == held["good"].held_tokens
        reasons = {p.agent_id: p.reason for p in sched.state_problems}
        assert set(reasons) == {"flipped", "garbled", "changed"}
        assert "checksum" in reasons["flipped"] and "checksum" in reasons["garbled"]
        assert "content differs" in reasons["changed"]
        assert sched.decode("good", " and more", 2).restored
        server = Daemon(sock_dir / "state.sock", sched).start()
        try:
            with Client(server.path, timeout=WAIT_S) as client:
                status = client.status()
            assert status["state_restored"] == "2" and status["state_skipped"] == "3"
            assert {p["state_skipped_agent"] for p in status["state_problems"]} == {"flipped", "garbled", "changed"}
        finally:
            server.stop()


def test_unregister_forgets_the_saved_state(tmp_path, tiny_model_path):
    state = tmp_path / "state"
    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state) as sched:
        sched.register("gone", tiny_model_path, N_CTX)
        sched.decode("gone", "soon forgotten", 2)
    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state) as sched:
        assert [a.agent_id for a in sched.agents()] == ["gone"]
        sched.unregister("gone")
        assert list(state.glob("gone*")) == []
    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state) as sched:
        assert sched.agents() == [] and sched.state_problems == []


def test_one_state_dir_serves_one_daemon(tmp_path):
    from kvrt.state.agentstore import AgentStoreError

    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=tmp_path / "state"):
        with pytest.raises(AgentStoreError, match="in use"):
            Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=tmp_path / "state")


# -- 8. a short soak ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_short_soak_finds_no_lost_or_mixed_up_replies(tmp_path):
    tool = Path(__file__).resolve().parents[1] / "tools" / "soak_daemon.py"
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(tool), "--duration-s", "5", "--clients", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["violations"] == {} and summary["requests"] > 0 and summary["restart"]["same_tokens_held"]
