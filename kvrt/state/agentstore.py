"""Agents' state on disk, so that a daemon restart, or a crash, keeps them (``kvrt serve --state-dir DIR``).

Two files per agent in the state directory:

``<agent_id>.agent.json``
    the manifest: agent id, model path and model fingerprint, ``n_ctx`` (its context's
    size now), the tokens its KV holds, tokens served, its transcript (every token of its
    history; the KV holds all of it or all but the last, which the next turn feeds), its
    context policy and kept prefix, and the name and checksum of its KV file. It carries a
    BLAKE2b checksum of its canonical JSON, so a damaged or hand-edited manifest is refused,
    never misread.
``<agent_id>+<n_tokens>.<random>.kvs``
    the agent's KV state in kvrt's snapshot file format (:mod:`kvrt.state.snapshot_file`:
    header with the hash of the tokens it holds, checksum); none while the agent holds no
    tokens. Every save writes a new name, so a file a manifest names is never rewritten.

Binding: a KV file is restored only for the manifest that names it, when its checksum is
the one the manifest recorded and its token hash is that of the manifest's transcript: a
KV file swapped between two agents, or a transcript that is not the one the KV holds, is
a :class:`StateProblem`, never a silent restore.

Crash consistency: every file is written whole (:func:`kvrt._files.write_atomic`), the KV
file before the manifest that names it, and older KV files are removed after; a crash at
any instant leaves the previous consistent pair or the new one, plus files nothing names
(removed by the next :meth:`AgentStore.load`). :meth:`AgentStore.load` verifies every
manifest and returns what it could read plus one :class:`StateProblem` per file it could
not: one bad file never costs the other agents. A save that fails is raised and remembered
in :attr:`AgentStore.unsaved` until that agent's next save succeeds, so the daemon can say
which agents a restart would lose or roll back. One daemon per directory: the store holds
an exclusive lock on ``DIR/lock`` for its lifetime.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import stat
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvrt._files import fsync_directory, remove_temporaries, write_atomic
from kvrt.engine.model import ModelFingerprint
from kvrt.errors import KvrtError
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot, SnapshotError, token_hash
from kvrt.state.snapshot_file import file_digest

MANIFEST_SUFFIX = ".agent.json"
KV_SUFFIX = ".kvs"
MANIFEST_VERSION = 3
_LOCK_NAME = "lock"
_DIGEST = 16
_INT_FIELDS = ("n_ctx", "n_tokens", "served_tokens")
log = logging.getLogger("kvrt.state.agentstore")


class AgentStoreError(KvrtError):
    """The state directory cannot be used (not a directory, not writable, or another daemon's)."""


class StateFileError(AgentStoreError):
    """One agent's saved state cannot be used; ``file`` names the file at fault."""

    def __init__(self, file: str, message: str) -> None:
        self.file = file
        super().__init__(message)


@dataclass(frozen=True)
class AgentRecord:
    """What a restarted daemon needs to bring one agent back.

    ``kv_file`` and ``kv_digest`` name the KV file and its checksum; :meth:`AgentStore.load`
    sets them from the manifest, and :meth:`AgentStore.save` chooses them (what a caller
    passes there is ignored).
    """

    agent_id: str
    model_path: str
    fingerprint: ModelFingerprint
    n_ctx: int
    n_tokens: int
    served_tokens: int
    transcript: tuple[int, ...] = ()
    policy: dict[str, object] = field(default_factory=dict)  # keyword arguments of the scheduler's ContextPolicy
    keep: int | None = None
    kv_file: str | None = None
    kv_digest: str | None = None

    @property
    def manifest_name(self) -> str:
        return self.agent_id + MANIFEST_SUFFIX


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
            "keep": record.keep, "kv_file": record.kv_file, "kv_digest": record.kv_digest}
    return json.dumps({"record": body, "checksum": _digest(body)}, sort_keys=True, separators=(",", ":")).encode()


def _decode_manifest(name: str, data: bytes, agent_id: str) -> AgentRecord:
    """The record in manifest file ``name`` (of ``agent_id``), or :class:`StateFileError` saying what is wrong."""
    try:
        outer = json.loads(data)
        body, checksum = outer["record"], outer["checksum"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
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
    kv_file, kv_digest = body.get("kv_file"), body.get("kv_digest")
    if body["n_tokens"] and not (isinstance(kv_file, str) and _is_kv_name(kv_file, agent_id)
                                 and isinstance(kv_digest, str)):
        raise StateFileError(name, f"{name}: names no valid KV file of agent {agent_id!r} for its "
                                   f"{body['n_tokens']} tokens (kv_file={kv_file!r})")
    return AgentRecord(agent_id, body["model_path"], fingerprint, body["n_ctx"], body["n_tokens"],
                       body["served_tokens"], tuple(transcript), policy, keep, kv_file if body["n_tokens"] else None,
                       kv_digest if body["n_tokens"] else None)


def _is_kv_name(name: str, agent_id: str) -> bool:
    """Whether ``name`` is a KV file name of ``agent_id`` (``+`` cannot occur in an agent id, nor ``/``)."""
    return name.startswith(agent_id + "+") and name.endswith(KV_SUFFIX) and "/" not in name


def _regular(path: Path) -> None:
    """``OSError`` unless ``path`` is a regular file itself (not a symlink, directory, FIFO...)."""
    mode = path.lstat().st_mode
    if not stat.S_ISREG(mode):
        kind = "a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise OSError(f"{path.name} is {kind}; a state file must be a regular file")


class AgentStore:
    """The state directory of one daemon: save, load, forget agents (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).absolute()
        self.unsaved: dict[str, str] = {}  # agent id -> why its last save or removal failed
        self._unsaved_lock = threading.Lock()
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock_fd: int | None = os.open(self.directory / _LOCK_NAME,
                                                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise AgentStoreError(f"cannot use state directory {self.directory}: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise AgentStoreError(f"state directory {self.directory} is in use by another daemon "
                                  f"(it holds {self.directory / _LOCK_NAME})") from None
        for name in remove_temporaries(self.directory):
            log.info("removed %s from %s: a write a crash interrupted", name, self.directory)

    def save(self, record: AgentRecord, snapshot: Snapshot | None) -> None:
        """Persist ``record`` with ``snapshot``, its KV state of ``record.n_tokens`` tokens (None for none).

        The snapshot must carry the hash of ``record.transcript[:n_tokens]``. A failure is
        an :class:`AgentStoreError` naming the agent and the directory, and is kept in
        :attr:`unsaved`; the files saved before stay as they were.
        """
        held = snapshot.n_tokens if snapshot is not None else 0
        if held != record.n_tokens or (snapshot is not None
                                       and snapshot.tokens_hash != token_hash(record.transcript[:held])):
            raise AgentStoreError(f"agent {record.agent_id!r}: its snapshot ({held} tokens) is not the KV state of "
                                  f"its transcript's first {record.n_tokens} tokens")
        try:
            kv_file = kv_digest = None
            if snapshot is not None:
                kv_file = f"{record.agent_id}+{record.n_tokens}.{secrets.token_hex(4)}{KV_SUFFIX}"
                snapshot.save(self.directory / kv_file)
                kv_digest = file_digest(self.directory / kv_file)
            manifest = _encode_manifest(replace(record, kv_file=kv_file, kv_digest=kv_digest))
            write_atomic(self.directory / record.manifest_name, lambda fh: fh.write(manifest))
            self._remove_kv_files(record.agent_id, keep=kv_file)
        except (OSError, SnapshotError) as exc:
            self.failed(record.agent_id, f"not saved to {self.directory}: {exc}")
            raise AgentStoreError(f"agent {record.agent_id!r}: {self.unsaved[record.agent_id]}") from exc
        with self._unsaved_lock:
            self.unsaved.pop(record.agent_id, None)

    def remove(self, agent_id: str) -> None:
        """Forget an agent: its manifest first (so no half-removed agent is ever restored), then its KV files.

        A failure is an :class:`AgentStoreError` (kept in :attr:`unsaved`: a restart would bring the agent back).
        """
        try:
            (self.directory / (agent_id + MANIFEST_SUFFIX)).unlink(missing_ok=True)
            self._remove_kv_files(agent_id, keep=None)
        except OSError as exc:
            self.failed(agent_id, f"unregistered, but its files in {self.directory} could not be removed "
                                   f"(a restart brings it back): {exc}")
            raise AgentStoreError(f"agent {agent_id!r}: {self.unsaved[agent_id]}") from exc
        with self._unsaved_lock:
            self.unsaved.pop(agent_id, None)

    def refused(self, agent_id: str) -> None:
        """Forget the failed save of an agent that was then refused (never admitted): nothing of it is lost."""
        with self._unsaved_lock:
            self.unsaved.pop(agent_id, None)

    def failed(self, agent_id: str, reason: str) -> None:
        """Log that ``agent_id``'s latest state is not saved, and why; kept in :attr:`unsaved` until a save succeeds."""
        log.error("agent %r: %s", agent_id, reason)
        with self._unsaved_lock:
            self.unsaved[agent_id] = reason

    def _remove_kv_files(self, agent_id: str, keep: str | None) -> None:
        removed = False
        for path in self.directory.glob(f"{agent_id}+*{KV_SUFFIX}"):  # agent ids hold no glob metacharacters
            if path.name != keep:
                path.unlink(missing_ok=True)
                removed = True
        if removed:
            fsync_directory(self.directory)

    def load(self) -> tuple[list[AgentRecord], list[StateProblem]]:
        """Every agent whose manifest reads back whole, and one problem per file that does not.

        KV files no manifest names are what a crash in the middle of a save left: removed
        when their agent's manifest names another one, reported (and left) when no
        manifest of their agent exists.
        """
        records: list[AgentRecord] = []
        problems: list[StateProblem] = []
        for path in sorted(self.directory.glob("*" + MANIFEST_SUFFIX)):
            agent_id = path.name[:-len(MANIFEST_SUFFIX)]
            try:
                _regular(path)
                records.append(_decode_manifest(path.name, path.read_bytes(), agent_id))
            except OSError as exc:
                problems.append(StateProblem(agent_id, path.name, f"{path.name}: cannot read: "
                                                                  f"{exc.strerror or exc}"))
            except StateFileError as exc:
                problems.append(StateProblem(agent_id, exc.file, str(exc)))
        named = {r.agent_id: r.kv_file for r in records}
        listed = named.keys() | {p.agent_id for p in problems}
        for path in sorted(self.directory.glob("*+*" + KV_SUFFIX)):
            agent_id = path.name.split("+", 1)[0]
            if agent_id in named and named[agent_id] != path.name:
                path.unlink(missing_ok=True)
                log.info("removed %s: no manifest names it (a save a crash interrupted)", path.name)
            elif agent_id not in listed:
                problems.append(StateProblem(agent_id, path.name, f"{path.name}: a KV file with no manifest "
                                                                  f"({agent_id + MANIFEST_SUFFIX} is missing): "
                                                                  "not restored, left in place"))
        return records, problems

    def load_snapshot(self, record: AgentRecord, pool: HostPool | None = None) -> Snapshot | None:
        """The record's KV state read back and verified against its manifest (checksum, tokens, model)."""
        name = record.kv_file
        if name is None:
            return None
        path = self.directory / name
        try:
            _regular(path)
            digest = file_digest(path)
        except OSError as exc:
            raise StateFileError(name, f"{name} (named by {record.manifest_name}) cannot be read: "
                                       f"{exc.strerror or exc}") from exc
        if digest != record.kv_digest:
            raise StateFileError(name, f"{name} is not the KV file {record.manifest_name} was saved with "
                                       "(checksum differs): replaced, swapped or damaged")
        try:
            snapshot = Snapshot.load(path, pool)
        except SnapshotError as exc:
            raise StateFileError(name, str(exc)) from exc
        expected = token_hash(record.transcript[:record.n_tokens])
        mismatch = (f"it holds {snapshot.n_tokens} tokens" if snapshot.n_tokens != record.n_tokens
                    else "its tokens are not the transcript's" if snapshot.tokens_hash != expected
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
