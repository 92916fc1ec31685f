"""KV snapshots of one sequence: capture once, restore into any compatible context and sequence.

A :class:`Snapshot` holds the bytes of ``llama_state_seq_get_data_ext`` plus what is
needed to refuse a wrong restore *before* llama.cpp parses them: the model's
fingerprint, the token count (restored decoding continues at position ``n_tokens``,
which llama.cpp takes from the cell positions stored in the state), a hash of the token
ids, and the context parameters that change the state's layout. The size is always
asked from llama.cpp (``llama_state_seq_get_size_ext``), never computed by formula.

Tiers, one interface:

``host``
    the full state in a :class:`kvrt.state.hostpool.HostBuffer` (pinned on a GPU machine).
    Restores into any compatible context, any sequence, any number of times.
``device``
    ``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``. What llama.cpp 0.3.36 does with it (read in
    ``llama-context.cpp``): the host blob holds only metadata (cell positions and
    per-layer headers, ~43 KB for a 3.5k-token 7B state); the tensor rows are copied
    into a buffer owned by the *context* (``mem_storage[seq_id]``) on the device that
    holds the KV cache. Consequences kvrt enforces, because llama.cpp aborts the
    process (``GGML_ASSERT``/``GGML_ABORT``) instead of returning an error: restore
    only into the same context; only the latest device capture of that source
    sequence is valid (capturing it again overwrites the copy); the returned byte
    count covers the metadata only, not the tensors. The copy lives as long as the
    context. It cannot be saved to disk. It works on a CPU build too (the "device"
    is then host memory).
``disk``
    the host bytes written to a file (header, BLAKE2b checksum, atomic rename) and
    read back, verified, on restore; a truncated or altered file is refused whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import struct
import tempfile
import threading
import typing
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from kvrt.bindings import STATE_SEQ_FLAGS_NONE, STATE_SEQ_FLAGS_ON_DEVICE
from kvrt.engine.context import Context
from kvrt.engine.model import ModelFingerprint
from kvrt.errors import KvrtError
from kvrt.state.hostpool import HostBuffer, HostPool, HostPoolError, default_pool

Tier = Literal["host", "device", "disk"]
TIERS: tuple[str, ...] = ("host", "device", "disk")

MAGIC = b"KVRTSNAP"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_DIGEST = 16
_READ_CHUNK = 64 << 20
MAX_HEADER = 1 << 20  # a real header is ~400 bytes; a longer length field is damage, not data


class SnapshotError(KvrtError):
    """A snapshot cannot be captured, restored, saved or loaded."""


class SnapshotMismatch(SnapshotError):
    """Restoring would put the state into a model or context it does not fit."""


class SnapshotCorrupt(SnapshotError):
    """A snapshot file is truncated, altered or not a kvrt snapshot."""


def token_hash(tokens: Sequence[int] | np.ndarray) -> str:
    """A stable digest of token ids (int32, little-endian)."""
    return hashlib.blake2b(np.asarray(tokens, dtype="<i4").tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class StateLayout:
    """Context parameters that decide whether a state fits a context.

    ``n_stream`` is how many KV streams the cache has (1 with unified KV, else one per
    sequence): llama.cpp refuses a state from a cache with another count. ``flash_attn``
    decides whether V is stored transposed; ``swa_full`` how sliding-window layers keep
    their cells. ``n_ctx_seq`` is recorded for the report; a target only needs room for
    the snapshot's tokens.
    """

    n_ctx_seq: int
    n_stream: int
    flash_attn: str
    swa_full: bool

    @classmethod
    def of(cls, ctx: Context) -> StateLayout:
        n_stream = 1 if ctx.params.kv_unified else ctx.n_seq_max
        return cls(ctx.n_ctx_seq, n_stream, ctx.params.flash_attn, ctx.params.swa_full)


# Which device capture of (context, source sequence) is current: a new capture overwrites
# llama.cpp's copy, so every older device snapshot of that pair becomes invalid.
_device_generations: weakref.WeakKeyDictionary[Context, dict[int, int]] = weakref.WeakKeyDictionary()
_device_lock = threading.Lock()


class Snapshot:
    """The KV state of one sequence, in one tier (see the module docstring).

    Release it with :meth:`release` or a ``with`` block; one dropped unreleased gives its
    host buffer and temporary file back when it is collected, or at interpreter exit.
    """

    def __init__(self, *, tier: Tier, fingerprint: ModelFingerprint, layout: StateLayout, n_tokens: int,
                 nbytes: int, tokens_hash: str | None, buffer: HostBuffer | None = None,
                 path: Path | None = None, owns_path: bool = False, device_ctx: Context | None = None,
                 source_seq: int = 0, generation: int = 0) -> None:
        self.tier = tier
        self.fingerprint = fingerprint
        self.layout = layout
        self.n_tokens = n_tokens
        self.nbytes = nbytes
        self.tokens_hash = tokens_hash
        self._buffer = buffer
        self.path = path
        self._device_ctx = weakref.ref(device_ctx) if device_ctx is not None else None
        self.source_seq = source_seq
        self._generation = generation
        self._finalizer = weakref.finalize(self, _give_back, buffer, path if owns_path else None)

    # -- capture ------------------------------------------------------------------------
    @classmethod
    def capture(cls, ctx: Context, seq_id: int = 0, *, tier: Tier = "host", pool: HostPool | None = None,
                tokens: Sequence[int] | None = None, path: str | os.PathLike[str] | None = None) -> Snapshot:
        """Copy the state of ``seq_id`` out of ``ctx``.

        ``tokens`` (the ids the sequence holds) are checked against its length and
        hashed so a restore can be matched to its text. ``path`` names the file of a
        ``disk`` snapshot (default: a temporary file the snapshot deletes on release).
        """
        if tier not in TIERS:
            raise SnapshotError(f"unknown snapshot tier {tier!r}; choose one of {TIERS}")
        n_tokens = ctx.seq_len(seq_id)
        if n_tokens == 0:
            raise SnapshotError(f"sequence {seq_id} holds no tokens; there is nothing to capture")
        if ctx.seq_pos_min(seq_id) != 0:
            raise SnapshotError(f"sequence {seq_id} starts at position {ctx.seq_pos_min(seq_id)}, not 0: "
                                "a snapshot must hold a whole prefix")
        if tokens is not None and len(tokens) != n_tokens:
            raise SnapshotError(f"{len(tokens)} token ids given but sequence {seq_id} holds {n_tokens} tokens")
        common = dict(fingerprint=ctx.model.fingerprint, layout=StateLayout.of(ctx), n_tokens=n_tokens,
                      tokens_hash=token_hash(tokens) if tokens is not None else None, source_seq=seq_id)
        target = _as_path(path, "save a snapshot to") if path is not None else None
        pool = pool or default_pool()
        if tier == "device":
            return cls._capture_device(ctx, seq_id, pool, common)
        size = ctx.seq_state_size(seq_id)
        buffer = pool.acquire(size)
        with _released_on_error(buffer):
            _shrink(buffer, ctx.seq_state_get(seq_id, buffer.view))
        snapshot = cls(tier="host", nbytes=buffer.nbytes, buffer=buffer, **common)
        if tier == "disk":
            return cls._to_disk(snapshot, target, common)
        return snapshot

    @classmethod
    def _to_disk(cls, host: Snapshot, path: Path | None, common: dict[str, Any]) -> Snapshot:
        """A disk snapshot of ``host`` (released here) at ``path``, or in a temporary file it owns."""
        owns = path is None
        with host:
            target = _temp_path() if path is None else path
            try:
                host.save(target)
                return cls(tier="disk", nbytes=host.nbytes, path=target, owns_path=owns, **common)
            except BaseException:
                if owns:
                    target.unlink(missing_ok=True)
                raise

    @classmethod
    def _capture_device(cls, ctx: Context, seq_id: int, pool: HostPool, common: dict[str, Any]) -> Snapshot:
        size = ctx.seq_state_size(seq_id, STATE_SEQ_FLAGS_ON_DEVICE)
        buffer = pool.acquire(size)
        with _released_on_error(buffer):
            _shrink(buffer, ctx.seq_state_get(seq_id, buffer.view, STATE_SEQ_FLAGS_ON_DEVICE))
        with _device_lock:
            generations = _device_generations.setdefault(ctx, {})
            generation = generations.get(seq_id, 0) + 1
            generations[seq_id] = generation
        return cls(tier="device", nbytes=buffer.nbytes, buffer=buffer, device_ctx=ctx,
                   generation=generation, **common)

    # -- restore ------------------------------------------------------------------------
    def check_compatible(self, ctx: Context, seq_id: int = 0) -> None:
        """Raise :class:`SnapshotMismatch` naming the first reason ``ctx`` cannot take this state."""
        self._check_live()
        diff = self.fingerprint.mismatch(ctx.model.fingerprint)
        if diff is not None:
            raise SnapshotMismatch(f"snapshot of model {self.fingerprint.description!r} cannot be restored into "
                                   f"{ctx.model.path.name!r}: {diff}")
        if not 0 <= seq_id < ctx.n_seq_max:
            raise SnapshotMismatch(f"sequence id {seq_id} is outside [0, {ctx.n_seq_max}) for the target context")
        target = StateLayout.of(ctx)
        if self.n_tokens > target.n_ctx_seq:
            raise SnapshotMismatch(f"snapshot holds {self.n_tokens} tokens but a sequence of the target context "
                                   f"has only {target.n_ctx_seq} cells (n_ctx={ctx.n_ctx}, "
                                   f"n_seq_max={ctx.n_seq_max}); captured with n_ctx_seq={self.layout.n_ctx_seq}")
        for field in ("n_stream", "flash_attn", "swa_full"):
            mine, theirs = getattr(self.layout, field), getattr(target, field)
            if mine != theirs:
                raise SnapshotMismatch(f"snapshot was captured with {field}={mine!r}, target context has "
                                       f"{field}={theirs!r}: the KV layout differs")
        if self.tier == "device":
            self._check_device(ctx)

    def _check_device(self, ctx: Context) -> None:
        owner = self._device_ctx() if self._device_ctx is not None else None
        if owner is not ctx:
            raise SnapshotMismatch("a device-tier snapshot lives in the context that captured it and can only be "
                                   "restored there (capture to the host tier to move state between contexts)")
        with _device_lock:
            current = _device_generations.get(ctx, {}).get(self.source_seq, 0)
        if current != self._generation:
            raise SnapshotMismatch(f"device-tier snapshot of sequence {self.source_seq} is stale: it is capture "
                                   f"#{self._generation} and capture #{current} has overwritten llama.cpp's copy")

    def restore(self, ctx: Context, seq_id: int = 0) -> None:
        """Replace sequence ``seq_id`` of ``ctx`` with this state (validated first)."""
        self.check_compatible(ctx, seq_id)
        if self.tier == "disk":
            loaded = Snapshot.load(self.path, expect=self)
            try:
                loaded.restore(ctx, seq_id)
            finally:
                loaded.release()
            return
        assert self._buffer is not None
        flags = STATE_SEQ_FLAGS_ON_DEVICE if self.tier == "device" else STATE_SEQ_FLAGS_NONE
        ctx.seq_state_set(self._buffer.view, seq_id, flags)
        held = ctx.seq_len(seq_id)
        if held != self.n_tokens:
            ctx.seq_rm(seq_id)
            raise SnapshotError(f"restore left sequence {seq_id} with {held} tokens instead of {self.n_tokens}")

    # -- disk -------------------------------------------------------------------------
    def _header(self) -> bytes:
        return json.dumps({
            "fingerprint": asdict(self.fingerprint), "layout": asdict(self.layout), "n_tokens": self.n_tokens,
            "nbytes": self.nbytes, "tokens_hash": self.tokens_hash,
        }, sort_keys=True).encode()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the snapshot to ``path`` atomically (temp file, fsync, rename); returns the path."""
        self._check_live()
        target = _as_path(path, "save a snapshot to")
        if self.tier == "device":
            raise SnapshotError("a device-tier snapshot keeps its tensors in the context; capture to the host "
                                "tier to save it")
        if self.tier == "disk":
            with Snapshot.load(self.path, expect=self) as loaded:
                return loaded.save(target)
        assert self._buffer is not None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        except OSError as exc:
            raise _save_error(target, exc) from exc
        try:
            with os.fdopen(fd, "wb") as fh:
                self._write(fh)
            os.replace(tmp, target)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise _save_error(target, exc) from exc
            raise
        return target

    def _write(self, fh: BinaryIO) -> None:
        """Prefix, header, state bytes and the BLAKE2b digest of everything after the magic; fsynced."""
        assert self._buffer is not None
        header = self._header()
        prefix = _PREFIX.pack(MAGIC, VERSION, len(header))
        payload = self._buffer.view
        digest = hashlib.blake2b(prefix[8:], digest_size=_DIGEST)
        digest.update(header)
        digest.update(payload)
        for part in (prefix, header, payload, digest.digest()):
            fh.write(part)
        fh.flush()
        os.fsync(fh.fileno())

    @classmethod
    def load(cls, path: str | os.PathLike[str], pool: HostPool | None = None, *,
             expect: Snapshot | None = None) -> Snapshot:
        """Read and verify a snapshot file into a host-tier snapshot; nothing partial is ever returned.

        Every failure is a :class:`SnapshotError` naming the file: :class:`SnapshotCorrupt`
        for contents that are not a whole, unaltered snapshot.
        """
        source = _as_path(path, "load a snapshot from")
        try:
            if not stat.S_ISREG(source.stat().st_mode):
                raise SnapshotError(f"cannot read snapshot file {source}: not a regular file")
            with source.open("rb") as fh:
                snapshot = cls._read(fh, source, os.fstat(fh.fileno()).st_size, pool or default_pool())
        except OSError as exc:
            raise SnapshotError(f"cannot read snapshot file {source}: {exc.strerror or exc}") from exc
        if expect is not None and (snapshot.fingerprint, snapshot.n_tokens, snapshot.tokens_hash) != (
                expect.fingerprint, expect.n_tokens, expect.tokens_hash):
            snapshot.release()
            raise SnapshotCorrupt(f"{source}: the file now holds a different snapshot than the one captured")
        return snapshot

    @classmethod
    def _read(cls, fh: BinaryIO, source: Path, size: int, pool: HostPool) -> Snapshot:
        """Parse and verify an open snapshot file of ``size`` bytes (sizes checked before anything is read)."""
        prefix = fh.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise SnapshotCorrupt(f"{source}: {size} bytes is too short for a kvrt snapshot header")
        magic, version, header_len = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise SnapshotCorrupt(f"{source}: not a kvrt snapshot (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise SnapshotCorrupt(f"{source}: snapshot format version {version}, this kvrt reads {VERSION}")
        if _PREFIX.size + header_len + _DIGEST > size:
            raise SnapshotCorrupt(f"{source}: header length {header_len} exceeds what the {size}-byte file can "
                                  "hold: truncated or not a kvrt snapshot")
        if header_len > MAX_HEADER:
            raise SnapshotCorrupt(f"{source}: header length {header_len} exceeds the limit of {MAX_HEADER} bytes")
        header_bytes = fh.read(header_len)
        header = _parse_header(source, header_bytes)
        nbytes = header["nbytes"]
        expected = _PREFIX.size + header_len + nbytes + _DIGEST
        if size != expected:
            raise SnapshotCorrupt(f"{source}: file is {size} bytes, its header promises {expected} "
                                  f"({nbytes} bytes of state): truncated or extended")
        digest = hashlib.blake2b(prefix[8:], digest_size=_DIGEST)
        digest.update(header_bytes)
        try:
            buffer = pool.acquire(nbytes)
        except HostPoolError as exc:
            raise SnapshotError(f"{source}: no host memory for its {nbytes} bytes of state: {exc}") from exc
        with _released_on_error(buffer):
            view = buffer.view
            for start in range(0, nbytes, _READ_CHUNK):
                chunk = view[start:start + _READ_CHUNK]
                if fh.readinto(memoryview(chunk)) != chunk.size:
                    raise SnapshotCorrupt(f"{source}: short read at byte {start} of the state")
                digest.update(chunk)
            if fh.read(_DIGEST) != digest.digest():
                raise SnapshotCorrupt(f"{source}: checksum mismatch: the file was altered or damaged")
            return cls(tier="host", fingerprint=ModelFingerprint(**header["fingerprint"]),
                       layout=StateLayout(**header["layout"]), n_tokens=header["n_tokens"], nbytes=nbytes,
                       tokens_hash=header["tokens_hash"], buffer=buffer)

    # -- lifetime -----------------------------------------------------------------------
    @property
    def pinned(self) -> bool:
        return self._buffer is not None and self._buffer.pinned

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def _check_live(self) -> None:
        if self.released:
            raise SnapshotError("this snapshot was released")

    def release(self) -> None:
        """Return the host buffer to its pool and delete a temporary disk file; releasing twice is harmless.

        A snapshot dropped unreleased does the same when it is collected or at interpreter exit.
        """
        self._finalizer()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"Snapshot({self.tier}, {self.n_tokens} tokens, {self.nbytes} bytes, "
                f"model {self.fingerprint.description!r}{', released' if self.released else ''})")


def _shrink(buffer: HostBuffer, written: int) -> None:
    """Make the buffer's view exactly the bytes llama.cpp wrote (it may write fewer than it sized)."""
    if written > buffer.nbytes:
        raise SnapshotError(f"llama.cpp wrote {written} bytes into a {buffer.nbytes}-byte buffer")
    buffer.nbytes = written


def _temp_path() -> Path:
    """A new empty temporary file for a disk snapshot that owns it."""
    try:
        fd, name = tempfile.mkstemp(prefix="kvrt-snapshot-", suffix=".kvs")
    except OSError as exc:
        raise SnapshotError(f"cannot create a temporary snapshot file in {tempfile.gettempdir()}: "
                            f"{exc.strerror or exc}") from exc
    os.close(fd)
    return Path(name)


def _give_back(buffer: HostBuffer | None, owned_path: Path | None) -> None:
    """A snapshot's finalizer: return its buffer and delete the file it owns (never references the snapshot)."""
    if buffer is not None:
        buffer.release()
    if owned_path is not None:
        try:
            owned_path.unlink(missing_ok=True)
        except OSError as exc:
            raise SnapshotError(f"cannot delete temporary snapshot file {owned_path}: {exc.strerror or exc}") from exc


@contextmanager
def _released_on_error(buffer: HostBuffer) -> Iterator[None]:
    """Release ``buffer`` if the block raises (it then never reaches a snapshot)."""
    try:
        yield
    except BaseException:
        buffer.release()
        raise


def _as_path(value: object, doing: str) -> Path:
    """``value`` as a :class:`Path`, or a :class:`SnapshotError` saying why it is not one."""
    if not isinstance(value, (str, os.PathLike)):
        raise SnapshotError(f"cannot {doing} {value!r}: a path must be a str or os.PathLike, "
                            f"got {type(value).__name__}")
    try:
        path = Path(value)
    except TypeError as exc:  # an os.PathLike whose __fspath__ gives bytes or junk
        raise SnapshotError(f"cannot {doing} {value!r}: not a usable path ({exc})") from None
    if "\0" in str(path):
        raise SnapshotError(f"cannot {doing} {str(path)!r}: a path cannot contain a NUL character")
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise SnapshotError(f"cannot {doing} {str(path)!r}: the file system cannot encode this path "
                            f"({exc.reason})") from None
    return path


def _save_error(target: Path, exc: OSError) -> SnapshotError:
    """The :class:`SnapshotError` of an ``OSError`` while saving to ``target``."""
    if isinstance(exc, FileNotFoundError) and not target.parent.is_dir():
        reason = f"folder {target.parent} does not exist"
    else:
        reason = exc.strerror or str(exc)
    return SnapshotError(f"cannot save snapshot to {target}: {reason}")


_HEADER_FIELDS: dict[str, Any] = {"fingerprint": ModelFingerprint, "layout": StateLayout, "n_tokens": int,
                                  "nbytes": int, "tokens_hash": (str, type(None))}


def _parse_header(source: Path, raw: bytes) -> dict[str, Any]:
    """The header's fields, each of its exact type; :class:`SnapshotCorrupt` naming the first that is not."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SnapshotCorrupt(f"{source}: snapshot header is not UTF-8 (byte {exc.start} of it)") from None
    except (ValueError, RecursionError) as exc:
        raise SnapshotCorrupt(f"{source}: snapshot header is not valid JSON ({exc})") from None
    out = _check_record(source, "header", header, _HEADER_FIELDS)
    for name, record in (("fingerprint", ModelFingerprint), ("layout", StateLayout)):
        hints = typing.get_type_hints(record)
        _check_record(source, name, out[name], {f.name: hints[f.name] for f in fields(record)})
    for name in ("n_tokens", "nbytes"):
        if out[name] <= 0:
            raise SnapshotCorrupt(f"{source}: snapshot header's {name} must be positive, got {out[name]}")
    return out


def _check_record(source: Path, name: str, value: object, types: dict[str, Any]) -> dict[str, Any]:
    """``value`` as a JSON object with exactly the fields of ``types``, each of its exact type (no bool for int)."""
    if not isinstance(value, dict):
        raise SnapshotCorrupt(f"{source}: snapshot {name} must be an object, got {type(value).__name__}")
    missing = [k for k in types if k not in value]
    extra = [k for k in value if k not in types]
    if missing or extra:
        what = f"missing field {missing[0]!r}" if missing else f"unexpected field {extra[0]!r}"
        raise SnapshotCorrupt(f"{source}: snapshot {name}: {what} (a damaged file or another format)")
    for key, kind in types.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if dataclasses.is_dataclass(kind):
            continue  # a nested record, checked by the caller
        if type(value[key]) not in kinds:
            wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise SnapshotCorrupt(f"{source}: snapshot {name}.{key} must be {wanted}, got {type(value[key]).__name__}")
    return value
