"""A hostile state dir: truncated, corrupted, swapped, re-signed, replaced-by-a-directory or symlinked files,
leftovers of a crash, a second daemon, an old format. Each damaged agent is a problem that names its file and
what is wrong, never a silent restore; every other agent comes back and continues exactly (CPU, tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvrt.accounting.ledger import VramLedger
from kvrt.serve.batched import BatchConfig, BatchedScheduler
from kvrt.serve.scheduler import Scheduler
from kvrt.state.agentstore import MANIFEST_SUFFIX, AgentStore, AgentStoreError, _digest
from test_daemon import N_CTX

AGENTS = ("a", "b", "c")
PROBE = " and what next"


def service(mode: str, state: Path) -> Scheduler | BatchedScheduler:
    """An agent service of ``mode`` on ``state``."""
    if mode == "per-agent":
        return Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state)
    return BatchedScheduler(VramLedger(1 << 34), state_dir=state,
                            config=BatchConfig(n_ctx=1024, n_seq_max=4, n_threads=1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model_path) -> dict[str, tuple[Path, dict[str, list[int]], dict[str, list[int]]]]:
    """Per mode: a state dir holding agents a, b, c (two turns each, different texts), their transcripts, and
    each agent's tokens for PROBE in an untouched copy of that state dir (the reference)."""
    out = {}
    for mode in ("per-agent", "batched"):
        state = tmp_path_factory.mktemp(f"state-{mode}")
        with service(mode, state) as sched:
            for agent in AGENTS:
                sched.register(agent, tiny_model_path, N_CTX)
                sched.decode(agent, f"the story of {agent}", 4)
                sched.decode(agent, f"then {agent} went", 4)
            transcripts = {agent: sched.transcript(agent) for agent in AGENTS}
        reference = tmp_path_factory.mktemp(f"reference-{mode}")
        copy_state(state, reference)
        with service(mode, reference) as sched:
            probes = {agent: sched.decode(agent, PROBE, 4).tokens for agent in AGENTS}
        out[mode] = (state, transcripts, probes)
    return out


def copy_state(source: Path, target: Path) -> None:
    for path in source.iterdir():
        if path.name != "lock":
            (target / path.name).write_bytes(path.read_bytes())


def kv_file(state: Path, agent: str) -> Path:
    [path] = state.glob(f"{agent}+*.kvs")
    return path


def manifest(state: Path, agent: str) -> Path:
    return state / (agent + MANIFEST_SUFFIX)


def resign(path: Path, change: Callable[[dict], None]) -> None:
    """Edit a manifest's record and give it a valid checksum again (an attacker who knows the format)."""
    outer = json.loads(path.read_bytes())
    change(outer["record"])
    outer["checksum"] = _digest(outer["record"])
    path.write_text(json.dumps(outer))


def swap_files(first: Path, second: Path) -> None:
    one, two = first.read_bytes(), second.read_bytes()
    first.write_bytes(two)
    second.write_bytes(one)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x20
    path.write_bytes(bytes(data))


def into_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def into_symlink(path: Path) -> None:
    target = path.with_name("elsewhere")
    path.rename(target)
    path.symlink_to(target)


def other_transcript(path: Path) -> None:
    def change(record: dict) -> None:
        record["transcript"][1] = record["transcript"][1] + 1
    resign(path, change)


# damage name -> (what it does to agent b's files, the words its problem must hold, modes it applies to)
KV_ONLY = ("per-agent",)  # batched agents have no KV file
DAMAGE: dict[str, tuple[Callable[[Path], None], tuple[str, ...], tuple[str, ...]]] = {
    "manifest truncated": (lambda s: truncate(manifest(s, "b")), ("b.agent.json", "not a kvrt agent manifest"),
                           ("per-agent", "batched")),
    "manifest bit flip": (lambda s: flip(manifest(s, "b")), ("b.agent.json",), ("per-agent", "batched")),
    "manifest is a directory": (lambda s: into_directory(manifest(s, "b")), ("b.agent.json", "directory"),
                                ("per-agent", "batched")),
    "manifest is a symlink": (lambda s: into_symlink(manifest(s, "b")), ("b.agent.json", "symlink"),
                              ("per-agent", "batched")),
    "transcript re-signed": (lambda s: other_transcript(manifest(s, "b")), ("b+", "not the transcript's"), KV_ONLY),
    "KV truncated": (lambda s: truncate(kv_file(s, "b")), ("b+", "checksum differs"), KV_ONLY),
    "KV bit flip": (lambda s: flip(kv_file(s, "b")), ("b+", "checksum"), KV_ONLY),
    "KV is a directory": (lambda s: into_directory(kv_file(s, "b")), ("b+", "directory"), KV_ONLY),
    "KV is a symlink": (lambda s: into_symlink(kv_file(s, "b")), ("b+", "symlink"), KV_ONLY),
    "KV missing": (lambda s: kv_file(s, "b").unlink(), ("b+", "No such file"), KV_ONLY),
    "manifest missing": (lambda s: manifest(s, "b").unlink(), ("b+", "no manifest"), KV_ONLY),
    "old manifest version": (lambda s: resign(manifest(s, "b"), lambda r: r.update(version=2)),
                             ("b.agent.json", "version 2"), ("per-agent", "batched")),
    "manifest of another agent": (lambda s: manifest(s, "b").write_bytes(manifest(s, "a").read_bytes()),
                                  ("b.agent.json", "holds agent 'a'"), ("per-agent", "batched")),
}


@pytest.mark.parametrize("mode, damage", [(mode, name) for name, (_, _, modes) in DAMAGE.items() for mode in modes])
def test_a_damaged_agent_is_named_and_the_others_continue_exactly(mode, damage, saved, tmp_path):
    action, words, _ = DAMAGE[damage]
    state, transcripts, probes = saved[mode]
    copy_state(state, tmp_path)
    action(tmp_path)
    with service(mode, tmp_path) as sched:
        [problem] = sched.state_problems
        assert problem.agent_id == "b" and all(word in problem.reason or word in problem.file for word in words), \
            problem
        assert sorted(a.agent_id for a in sched.agents()) == ["a", "c"] and sched.state_restored == 2
        for agent in ("a", "c"):
            assert sched.transcript(agent) == transcripts[agent]
            assert sched.decode(agent, PROBE, 4).tokens == probes[agent]


def test_kv_files_swapped_between_two_agents_restore_neither(saved, tmp_path):
    state, _, probes = saved["per-agent"]
    copy_state(state, tmp_path)
    first, second = kv_file(tmp_path, "a"), kv_file(tmp_path, "b")
    swapped_a, swapped_b = tmp_path / second.name.replace("b+", "a+"), tmp_path / first.name.replace("a+", "b+")
    first.rename(swapped_a)  # each agent's file now holds the other's state, under its own agent's name
    second.rename(swapped_b)
    swap_files(swapped_a, swapped_b)
    for agent, name in (("a", swapped_a.name), ("b", swapped_b.name)):  # and each manifest names its new file
        resign(manifest(tmp_path, agent), lambda record, name=name: record.update(kv_file=name))
    with service("per-agent", tmp_path) as sched:
        assert {p.agent_id: "checksum differs" in p.reason for p in sched.state_problems} == {"a": True, "b": True}
        assert sched.decode("c", PROBE, 4).tokens == probes["c"]


def test_crash_leftovers_are_cleared_and_do_not_cost_an_agent(saved, tmp_path):
    state, _, probes = saved["per-agent"]
    copy_state(state, tmp_path)
    (tmp_path / ".a.agent.json.x1y2.partial").write_text("half a manifest")
    orphan = tmp_path / (kv_file(tmp_path, "a").name.split(".")[0] + ".deadbeef.kvs")
    orphan.write_bytes(kv_file(tmp_path, "a").read_bytes())  # a new KV file whose manifest was never written
    with service("per-agent", tmp_path) as sched:
        assert sched.state_problems == [] and sched.state_restored == 3
        assert not orphan.exists() and not list(tmp_path.glob("*.partial"))
        assert sched.decode("a", PROBE, 4).tokens == probes["a"]


def test_a_state_dir_that_is_a_file_or_has_a_directory_for_a_lock_is_refused_by_name(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(AgentStoreError, match="cannot use state directory .*file"):
        AgentStore(tmp_path / "file")
    (tmp_path / "dir" / "lock").mkdir(parents=True)
    with pytest.raises(AgentStoreError, match="cannot use state directory .*dir.*lock"):
        AgentStore(tmp_path / "dir")


def test_a_second_daemon_on_the_same_state_dir_is_refused_and_the_first_keeps_its_agents(tmp_path,
                                                                                       tiny_model_path):
    state = tmp_path / "state"
    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state) as sched:
        sched.register("a", tiny_model_path, N_CTX)
        first = sched.decode("a", "hello there", 3)
        done = subprocess.run([sys.executable, "-m", "kvrt.cli", "serve", "--socket", str(tmp_path / "x.sock"),
                               "--state-dir", str(state)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "KVRT_NO_PRELOAD": "1"})
        assert done.returncode != 0 and "in use by another daemon" in done.stderr, done.stderr[-2000:]
        assert sched.decode("a", " and more", 3).unsaved is None
    with Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state) as sched:
        assert sched.state_problems == [] and len(sched.transcript("a")) > len(first.tokens)
