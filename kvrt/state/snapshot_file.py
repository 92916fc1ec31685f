"""kvrt's snapshot file format: a header naming the identity, the state bytes, and a checksum over both.

Layout: ``KVRTSNAP``, format version and header length (``<8sII``), the header (JSON of
:class:`kvrt.state.snapshot_identity.SnapshotIdentity` plus ``nbytes``), the state
bytes, and the BLAKE2b-128 digest of everything after the magic. Writes are atomic
(temporary file, fsync, rename, fsync of the directory); a read checks every size before reading and returns
nothing partial: a truncated, extended or altered file is :class:`SnapshotCorrupt`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import stat
import struct
import tempfile
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from kvrt._files import write_atomic
from kvrt.engine.model import ModelFingerprint
from kvrt.state.hostpool import HostBuffer, HostPool, HostPoolError
from kvrt.state.snapshot_identity import SnapshotCorrupt, SnapshotError, SnapshotIdentity, StateLayout

MAGIC = b"KVRTSNAP"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_DIGEST = 16
_READ_CHUNK = 64 << 20
MAX_HEADER = 1 << 20  # a real header is ~400 bytes; a longer length field is damage, not data


def write_file(path: str | os.PathLike[str], identity: SnapshotIdentity, payload: np.ndarray) -> Path:
    """Write ``identity`` and ``payload`` to ``path`` atomically (:func:`kvrt._files.write_atomic`); returns it."""
    target = as_path(path, "save a snapshot to")
    try:
        write_atomic(target, lambda fh: _write(fh, identity, payload))
    except OSError as exc:
        raise _save_error(target, exc) from exc
    return target


def _write(fh: BinaryIO, identity: SnapshotIdentity, payload: np.ndarray) -> None:
    """Prefix, header, state bytes and the BLAKE2b digest of everything after the magic."""
    header = json.dumps({**asdict(identity), "nbytes": payload.nbytes}, sort_keys=True).encode()
    prefix = _PREFIX.pack(MAGIC, VERSION, len(header))
    body = payload.data
    digest = hashlib.blake2b(prefix[8:], digest_size=_DIGEST)
    digest.update(header)
    digest.update(body)
    for part in (prefix, header, body, digest.digest()):
        fh.write(part)


def file_digest(path: Path) -> str:
    """The checksum a snapshot file ends with (hex), read without reading the rest: what binds the file to a
    record that names it (:mod:`kvrt.state.agentstore`). Its contents are verified when the file is read."""
    with path.open("rb") as fh:
        fh.seek(-_DIGEST, os.SEEK_END)
        return fh.read(_DIGEST).hex()


def read_file(path: str | os.PathLike[str], pool: HostPool, *,
              expect: SnapshotIdentity | None = None) -> tuple[SnapshotIdentity, HostBuffer]:
    """Read and verify a snapshot file: its identity and its state bytes in a buffer of ``pool``.

    Every failure is a :class:`SnapshotError` naming the file: :class:`SnapshotCorrupt`
    for contents that are not a whole, unaltered snapshot, or not the model and tokens of
    ``expect``.
    """
    source = as_path(path, "load a snapshot from")
    try:
        if not stat.S_ISREG(source.stat().st_mode):
            raise SnapshotError(f"cannot read snapshot file {source}: not a regular file")
        with source.open("rb") as fh:
            identity, buffer = _read(fh, source, os.fstat(fh.fileno()).st_size, pool)
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot file {source}: {exc.strerror or exc}") from exc
    if expect is not None and not identity.same_content(expect):
        buffer.release()
        raise SnapshotCorrupt(f"{source}: the file now holds a different snapshot than the one captured")
    return identity, buffer


def _read(fh: io.BufferedIOBase, source: Path, size: int, pool: HostPool) -> tuple[SnapshotIdentity, HostBuffer]:
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
    try:
        view = buffer.view
        for start in range(0, nbytes, _READ_CHUNK):
            chunk = view[start:start + _READ_CHUNK]
            if fh.readinto(chunk.data) != chunk.size:
                raise SnapshotCorrupt(f"{source}: short read at byte {start} of the state")
            digest.update(chunk.data)
        if fh.read(_DIGEST) != digest.digest():
            raise SnapshotCorrupt(f"{source}: checksum mismatch: the file was altered or damaged")
    except BaseException:
        buffer.release()
        raise
    identity = SnapshotIdentity(ModelFingerprint(**header["fingerprint"]), StateLayout(**header["layout"]),
                                header["n_tokens"], header["tokens_hash"])
    return identity, buffer


def temp_path() -> Path:
    """A new empty temporary file for a disk snapshot that owns it."""
    try:
        fd, name = tempfile.mkstemp(prefix="kvrt-snapshot-", suffix=".kvs")
    except OSError as exc:
        raise SnapshotError(f"cannot create a temporary snapshot file in {tempfile.gettempdir()}: "
                            f"{exc.strerror or exc}") from exc
    os.close(fd)
    return Path(name)


def as_path(value: object, doing: str) -> Path:
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
