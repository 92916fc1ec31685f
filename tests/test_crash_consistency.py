"""Saved agents survive ``kill -9`` of a real ``kvrt serve --socket`` subprocess (both modes), and a state dir
that stops taking writes is reported, never answered with a plain OK (CPU llama.cpp, tiny models).

The reference for "continues token-exactly" is the same turns in a daemon that was never interrupted.
A state dir stops taking writes three ways (:data:`READ_ONLY_WAYS`): kvrt's writes patched to fail
with ``EROFS`` (runs everywhere), a real read-only bind mount (``EROFS`` from the kernel; in a child
process inside ``unshare -rm``, a user and mount namespace that an unprivileged user may make where
the kernel allows it), and the directory's write permission taken away (``EACCES`` from the kernel;
permission bits do not bind root). A way this machine cannot take is skipped with the reason.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvrt.accounting.ledger import VramLedger
from kvrt.serve.batched import BatchConfig, BatchedScheduler
from kvrt.serve.client import Client, DaemonReplyError
from kvrt.serve.daemon import Daemon
from kvrt.serve.scheduler import Scheduler
from kvrt.state.agentstore import AgentStoreError
from test_daemon import N_CTX
from test_daemon_hardening import WAIT_S, one_context_capacity, serving

TURNS = [("a", "Hello, my name is"), ("b", "The capital"), ("a", "and then\nwe"), ("b", "of France is"),
         ("a", "so the end"), ("b", "is near")]
KILLED_AFTER = 3  # turns answered before the SIGKILL


def modes(model: Path) -> dict[str, tuple[str, ...]]:
    """The daemon's options per mode: per-agent with room for one live context (agents swap), and batched."""
    return {"per-agent": ("--capacity-bytes", str(one_context_capacity(model)), "--charge", "estimated"),
            "batched": ("--batch-slots", "4", "--batch-cells", "1024")}


def register_both(client: Client, model: Path, other: Path) -> None:
    client.register("a", model, N_CTX)
    client.register("b", other, N_CTX)


@pytest.mark.parametrize("mode", ["per-agent", "batched"])
def test_kill_9_between_turns_loses_nothing_and_agents_continue_token_exactly(mode, sock_dir, tmp_path,
                                                                               tiny_model_path, other_tiny_model_path):
    options = modes(tiny_model_path)[mode]
    state, log, path = tmp_path / "state", tmp_path / "serve.log", sock_dir / "crash.sock"
    with serving(path, log, *options, "--state-dir", str(state)) as proc:
        with Client(path, timeout=WAIT_S) as client:
            register_both(client, tiny_model_path, other_tiny_model_path)
            before = [client.decode(agent, prompt, 6) for agent, prompt in TURNS[:KILLED_AFTER]]
            assert all(d.fields["state_saved"] == "true" for d in before)
            held = {row["agent"]: row["held_tokens"] for row in client.list()}
        proc.kill()
        proc.wait()
    with serving(path, log, *options, "--state-dir", str(state)) as proc:
        with Client(path, timeout=WAIT_S) as client:
            status = client.status()
            assert (status["state_restored"], status["state_skipped"], status["state_unsaved"]) == ("2", "0", "0")
            assert {row["agent"]: row["held_tokens"] for row in client.list()} == held
            after = [client.decode(agent, prompt, 6) for agent, prompt in TURNS[KILLED_AFTER:]]
        proc.kill()
    with serving(sock_dir / "ref.sock", log, *options) as proc:
        with Client(sock_dir / "ref.sock", timeout=WAIT_S) as client:
            register_both(client, tiny_model_path, other_tiny_model_path)
            reference = [client.decode(agent, prompt, 6) for agent, prompt in TURNS]
        proc.kill()
    assert [d.text for d in before + after] == [d.text for d in reference]
    assert [d.fields["prompt_tokens"] for d in after] == [d.fields["prompt_tokens"]
                                                         for d in reference[KILLED_AFTER:]]


@pytest.mark.parametrize("mode", ["per-agent", "batched"])
def test_kill_9_in_the_middle_of_a_turn_restores_the_agent_before_or_after_it(mode, sock_dir, tmp_path,
                                                                              tiny_model_path,
                                                                              other_tiny_model_path):
    """The turn in flight is all that may be lost: each agent comes back whole, at a turn boundary."""
    options = modes(tiny_model_path)[mode]
    state, log, path = tmp_path / "state", tmp_path / "serve.log", sock_dir / "crash.sock"
    with serving(path, log, *options, "--state-dir", str(state)) as proc:
        with Client(path, timeout=WAIT_S) as client:
            register_both(client, tiny_model_path, other_tiny_model_path)
            client.decode("a", TURNS[0][1], 6)
            client.decode("b", TURNS[1][1], 6)
            held = {row["agent"]: int(row["held_tokens"]) for row in client.list()}
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(str(path))
            raw.sendall(b"DECODE a 150 stream=1 -- go on and on\n")
            first = raw.recv(4096)
            assert first.startswith(b"TOKEN"), first  # the turn is running
            proc.kill()
            proc.wait()
    with serving(path, log, *options, "--state-dir", str(state)) as proc:
        with Client(path, timeout=WAIT_S) as client:
            status = client.status()
            assert (status["state_restored"], status["state_skipped"]) == ("2", "0"), status
            now = {row["agent"]: int(row["held_tokens"]) for row in client.list()}
            assert now["b"] == held["b"] and now["a"] >= held["a"]
            assert client.decode("a", "and one more", 4).fields["state_saved"] == "true"
        proc.kill()


def fail_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on every atomic write fails as on a file system remounted read-only."""
    def refuse(target: Path, write: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(target))
    monkeypatch.setattr("kvrt.state.agentstore.write_atomic", refuse)
    monkeypatch.setattr("kvrt.state.snapshot_file.write_atomic", refuse)


READ_ONLY_WAYS = {"patched": "Read-only file system", "mount": "Read-only file system", "chmod": "Permission denied"}
MOUNT_NS_ENV = "KVRT_TEST_IN_MOUNT_NS"  # set in the child that runs inside ``unshare -rm``


def read_only(way: str, state: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Make ``state`` stop taking writes ``way``; returns what makes it writable again (harmless twice)."""
    if way == "patched":
        fail_writes(monkeypatch)
        return monkeypatch.undo
    if way == "mount":
        for argv in (["mount", "--bind", state, state], ["mount", "-o", "remount,bind,ro", state]):
            subprocess.run(argv, check=True, capture_output=True)
        return lambda: subprocess.run(["umount", state], check=False, capture_output=True) and None
    state.chmod(0o500)
    return lambda: state.chmod(0o700)


def refuse_unavailable(way: str, tmp_path: Path) -> None:
    """Skip, with the reason, a way this process cannot take: ``chmod`` where permission bits do not stop it
    (root, or any process with ``CAP_DAC_OVERRIDE``)."""
    if way != "chmod":
        return
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o500)
    try:
        (probe / "x").touch()
    except PermissionError:
        return
    pytest.skip(f"permission bits do not stop this user (uid {os.geteuid()}) from writing: no EACCES to test")


def in_a_mount_namespace(test_id: str) -> None:
    """Run test ``test_id`` of this file in a child inside a new user and mount namespace (``unshare -rm``), where a
    bind mount may be remounted read-only without root; skip, with the reason, where that is refused."""
    tried = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True, check=False) \
        if shutil.which("unshare") else None
    if tried is None or tried.returncode != 0:
        why = "no unshare command" if tried is None else tried.stderr.strip() or f"exit {tried.returncode}"
        pytest.skip(f"cannot make a user and mount namespace here ({why}): no real read-only mount to test")
    done = subprocess.run(["unshare", "-rm", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::{test_id}"], cwd=Path(__file__).parent.parent,
                          env={**os.environ, MOUNT_NS_ENV: "1"}, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def service(mode: str, state: Path) -> Scheduler | BatchedScheduler:
    """An agent service of ``mode`` on the state dir ``state``."""
    if mode == "per-agent":
        return Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state)
    return BatchedScheduler(VramLedger(1 << 34), state_dir=state,
                            config=BatchConfig(n_ctx=1024, n_seq_max=4, n_threads=1))


@pytest.mark.parametrize("way", sorted(READ_ONLY_WAYS))
@pytest.mark.parametrize("mode", ["per-agent", "batched"])
def test_a_state_dir_that_turns_read_only_is_reported_on_the_turn_in_status_and_at_close(
        mode, way, monkeypatch, sock_dir, tmp_path, tiny_model_path, request):
    if way == "mount" and not os.environ.get(MOUNT_NS_ENV):
        in_a_mount_namespace(request.node.name)
        return
    refuse_unavailable(way, tmp_path)
    state = tmp_path / "state"
    sched = service(mode, state)
    server = Daemon(sock_dir / "ro.sock", sched).start()
    try:
        with Client(server.path, timeout=WAIT_S) as client:
            client.register("kept", tiny_model_path, N_CTX)
            assert client.decode("kept", "first words", 3).fields["state_saved"] == "true"
            saved = sched.transcript("kept")
            writable_again = read_only(way, state, monkeypatch)
            request.addfinalizer(writable_again)  # also when an assertion below fails
            turn = client.decode("kept", "second words", 3)
            assert turn.fields["state_saved"] == "false" and READ_ONLY_WAYS[way] in turn.fields["state_error"]
            with pytest.raises(DaemonReplyError) as refused:
                client.register("new", tiny_model_path, N_CTX)
            assert refused.value.code == "STATE_NOT_SAVED" and "'new'" in str(refused.value)
            status = client.status()
            [unsaved] = status["state_unsaved_agents"]
            assert unsaved["state_unsaved_agent"] == "kept" and unsaved["reason"] in turn.fields["state_error"]
            assert [row["agent"] for row in client.list()] == ["kept"]  # the refused agent was not admitted
    finally:
        server.stop()
    assert set(sched.store.unsaved) == {"kept"}  # close() tried again and still could not save it
    writable_again()
    with service(mode, state) as again:  # the last saved state: before the second turn
        assert again.state_problems == [] and again.transcript("kept") == saved


def test_a_refused_save_keeps_the_files_saved_before(tmp_path, tiny_model_path, monkeypatch):
    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=tmp_path) as sched:
        sched.register("a", tiny_model_path, N_CTX)
        sched.decode("a", "one two three", 3)
        saved = sorted(p.name for p in tmp_path.iterdir())
        fail_writes(monkeypatch)
        assert sched.decode("a", "four", 3).unsaved is not None
        assert sorted(p.name for p in tmp_path.iterdir()) == saved
        with pytest.raises(AgentStoreError, match="not saved"):
            sched.fork("a", "b")
        assert [a.agent_id for a in sched.agents()] == ["a"]
