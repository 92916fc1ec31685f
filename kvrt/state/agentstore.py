"""Agents' state on disk, so that a daemon restart keeps them (``kvrt serve --state-dir DIR``).

Two files per agent in the state directory:

``<agent_id>.agent.json``
    the manifest: agent id, model path and model fingerprint, ``n_ctx`` (its context's
    size now), the tokens its KV holds, tokens served, its transcript (every token of its
    history; the KV holds all of it or all but the last, which the next turn feeds), its
    context policy and kept prefix. It carries a BLAKE2b checksum of its canonical JSON, so a damaged or
    hand-edited manifest is refused, never misread.
``<agent_id>+<n_tokens>.kvs``
    the agent's KV state in kvrt's snapshot file format (:meth:`kvrt.state.snapshot.Snapshot.save`:
    header, checksum, atomic rename); none while the agent holds no tokens.

A save writes the KV file first and then replaces the manifest atomically, so a manifest
always names a complete KV file; a crash in between leaves the previous consistent pair
(plus a KV file nothing names, which that agent's next save removes). :meth:`AgentStore.load`
verifies every manifest and returns what it could read plus one :class:`StateProblem` per
agent it could not: one bad file never costs the other agents. One daemon per directory:
the store holds an exclusive lock on ``DIR/lock`` for its lifetime.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvrt.engine.model import ModelFingerprint
from kvrt.errors import KvrtError
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot, SnapshotError

MANIFEST_SUFFIX = ".agent.json"
MANIFEST_VERSION = 2
_LOCK_NAME = "lock"
_DIGEST = 16
_INT_FIELDS = ("n_ctx", "n_tokens", "served_tokens")


class AgentStoreError(KvrtError):
    """The state directory cannot be used (not a directory, not writable, or another daemon's)."""


class StateFileError(AgentStoreError):
    """One agent's saved state cannot be used; ``file`` names the file at fault."""

    def __init__(self, file: str, message: str) -> None:
        self.file = file
        super().__init__(message)


@dataclass(frozen=True)
class AgentRecord:
    """What a restarted daemon needs to bring one agent back."""

    agent_id: str
    model_path: str
    fingerprint: ModelFingerprint
    n_ctx: int
    n_tokens: int
    served_tokens: int
    transcript: tuple[int, ...] = ()
    policy: dict[str, object] = field(default_factory=dict)  # keyword arguments of the scheduler's ContextPolicy
    keep: int | None = None

    @property
    def manifest_name(self) -> str:
        return self.agent_id + MANIFEST_SUFFIX

    @property
    def snapshot_name(self) -> str | None:
        """The KV file's name (``+`` cannot occur in an agent id), or None when nothing is held."""
        return f"{self.agent_id}+{self.n_tokens}.kvs" if self.n_tokens else None


@dataclass(frozen=True)
class StateProblem:
    """A saved agent that was not restored, the file at fault and why."""

    agent_id: str
    file: str
    reason: str


def _digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(canonical.encode(), digest_size=_DIGEST).hexdigest()


def _encode_manifest(record: AgentRecord) -> bytes:
    body = {"version": MANIFEST_VERSION, "agent_id": record.agent_id, "model_path": record.model_path,
            "fingerprint": asdict(record.fingerprint), "n_ctx": record.n_ctx, "n_tokens": record.n_tokens,
            "served_tokens": record.served_tokens, "transcript": list(record.transcript), "policy": record.policy,
            "keep": record.keep}
    return json.dumps({"record": body, "checksum": _digest(body)}, sort_keys=True, indent=1).encode() + b"\n"


def _decode_manifest(name: str, data: bytes, agent_id: str) -> AgentRecord:
    """The record in manifest file ``name`` (of ``agent_id``), or :class:`StateFileError` saying what is wrong."""
    try:
        outer = json.loads(data)
        body, checksum = outer["record"], outer["checksum"]
    except (ValueError, TypeError, KeyError) as exc:
        raise StateFileError(name, f"{name}: not a kvrt agent manifest ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict) or checksum != _digest(body):
        raise StateFileError(name, f"{name}: manifest checksum mismatch: the file was altered or damaged")
    if body.get("version") != MANIFEST_VERSION:
        raise StateFileError(name, f"{name}: manifest version {body.get('version')!r}, this kvrt reads "
                                   f"{MANIFEST_VERSION}")
    if body.get("agent_id") != agent_id:
        raise StateFileError(name, f"{name}: holds agent {body.get('agent_id')!r}, not {agent_id!r}")
    bad = [key for key in _INT_FIELDS if type(body.get(key)) is not int or body[key] < 0]
    if bad or not isinstance(body.get("model_path"), str):
        raise StateFileError(name, f"{name}: missing or invalid field(s) {bad or ['model_path']}")
    try:
        fingerprint = ModelFingerprint(**body["fingerprint"])
    except TypeError as exc:
        raise StateFileError(name, f"{name}: invalid model fingerprint ({exc})") from None
    transcript, policy, keep = body.get("transcript"), body.get("policy"), body.get("keep")
    if (not isinstance(transcript, list) or any(type(t) is not int or t < 0 for t in transcript)
            or not (body["n_tokens"] == 0 or 0 <= len(transcript) - body["n_tokens"] <= 1)):
        raise StateFileError(name, f"{name}: the transcript is not a list of token ids holding the "
                                   f"{body['n_tokens']} tokens of the KV state (and at most one more; with no KV "
                                   "state, any transcript: it is recomputed)")
    if not isinstance(policy, dict) or (keep is not None and (type(keep) is not int or keep < 0)):
        raise StateFileError(name, f"{name}: invalid context policy {policy!r} or kept prefix {keep!r}")
    return AgentRecord(agent_id, body["model_path"], fingerprint, body["n_ctx"], body["n_tokens"],
                       body["served_tokens"], tuple(transcript), policy, keep)


def _write_atomic(target: Path, data: bytes) -> None:
    """Replace ``target`` with ``data`` whole: temporary file, fsync, rename, fsync of the directory."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class AgentStore:
    """The state directory of one daemon: save, load, forget agents (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).absolute()
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock_fd: int | None = os.open(self.directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                                0o600)
        except OSError as exc:
            raise AgentStoreError(f"cannot use state directory {self.directory}: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise AgentStoreError(f"state directory {self.directory} is in use by another daemon "
                                  f"(it holds {self.directory / _LOCK_NAME})") from None

    def save(self, record: AgentRecord, snapshot: Snapshot | None) -> None:
        """Persist ``record`` with ``snapshot``, its KV state holding ``record.n_tokens`` tokens (None for none)."""
        if (snapshot.n_tokens if snapshot is not None else 0) != record.n_tokens:
            raise AgentStoreError(f"agent {record.agent_id!r}: the record says {record.n_tokens} tokens, "
                                  f"the snapshot holds {snapshot.n_tokens if snapshot else 0}")
        if snapshot is not None and record.snapshot_name is not None:
            snapshot.save(self.directory / record.snapshot_name)
        _write_atomic(self.directory / record.manifest_name, _encode_manifest(record))
        self._remove_snapshots(record.agent_id, keep=record.snapshot_name)

    def remove(self, agent_id: str) -> None:
        """Forget an agent: its manifest first (so no half-removed agent is ever restored), then its KV files."""
        (self.directory / (agent_id + MANIFEST_SUFFIX)).unlink(missing_ok=True)
        self._remove_snapshots(agent_id, keep=None)

    def _remove_snapshots(self, agent_id: str, keep: str | None) -> None:
        for path in self.directory.glob(f"{agent_id}+*.kvs"):  # agent ids hold no glob metacharacters
            if path.name != keep:
                path.unlink(missing_ok=True)

    def load(self) -> tuple[list[AgentRecord], list[StateProblem]]:
        """Every agent whose manifest reads back whole, and one problem per manifest that does not."""
        records: list[AgentRecord] = []
        problems: list[StateProblem] = []
        for path in sorted(self.directory.glob("*" + MANIFEST_SUFFIX)):
            agent_id = path.name[:-len(MANIFEST_SUFFIX)]
            try:
                records.append(_decode_manifest(path.name, path.read_bytes(), agent_id))
            except OSError as exc:
                problems.append(StateProblem(agent_id, path.name, f"{path.name}: cannot read: {exc}"))
            except StateFileError as exc:
                problems.append(StateProblem(agent_id, exc.file, str(exc)))
        return records, problems

    def load_snapshot(self, record: AgentRecord, pool: HostPool | None = None) -> Snapshot | None:
        """The record's KV state read back and verified (file checksum, tokens, model), in host memory."""
        name = record.snapshot_name
        if name is None:
            return None
        try:
            snapshot = Snapshot.load(self.directory / name, pool)
        except SnapshotError as exc:
            raise StateFileError(name, str(exc)) from exc
        mismatch = (f"it holds {snapshot.n_tokens} tokens" if snapshot.n_tokens != record.n_tokens
                    else snapshot.fingerprint.mismatch(record.fingerprint))
        if mismatch is not None:
            snapshot.release()
            raise StateFileError(name, f"{name} does not match its manifest {record.manifest_name}: {mismatch}")
        return snapshot

    def close(self) -> None:
        """Release the directory's lock (idempotent)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
