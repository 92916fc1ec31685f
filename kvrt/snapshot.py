"""KV snapshots of one sequence: capture once, restore into any compatible context and sequence.

A :class:`Snapshot` holds the bytes of ``llama_state_seq_get_data_ext`` plus what is
needed to refuse a wrong restore *before* llama.cpp parses them: the model's
fingerprint, the token count (restored decoding continues at position ``n_tokens``,
which llama.cpp takes from the cell positions stored in the state), a hash of the token
ids, and the context parameters that change the state's layout. The size is always
asked from llama.cpp (``llama_state_seq_get_size_ext``), never computed by formula.

Tiers, one interface:

``host``
    the full state in a :class:`kvrt.hostpool.HostBuffer` (pinned on a GPU machine).
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

import hashlib
import json
import os
import struct
import tempfile
import threading
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvrt.bindings import STATE_SEQ_FLAGS_NONE, STATE_SEQ_FLAGS_ON_DEVICE
from kvrt.context import Context
from kvrt.errors import KvrtError
from kvrt.hostpool import HostBuffer, HostPool, default_pool
from kvrt.model import ModelFingerprint

Tier = Literal["host", "device", "disk"]
TIERS: tuple[str, ...] = ("host", "device", "disk")

MAGIC = b"KVRTSNAP"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_DIGEST = 16
_READ_CHUNK = 64 << 20


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
    """The KV state of one sequence, in one tier (see the module docstring)."""

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
        self._owns_path = owns_path
        self._device_ctx = weakref.ref(device_ctx) if device_ctx is not None else None
        self.source_seq = source_seq
        self._generation = generation
        self._released = False

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
        pool = pool or default_pool()
        if tier == "device":
            return cls._capture_device(ctx, seq_id, pool, common)
        size = ctx.seq_state_size(seq_id)
        buffer = pool.acquire(size)
        try:
            written = ctx.seq_state_get(seq_id, buffer.view)
        except BaseException:
            buffer.release()
            raise
        snapshot = cls(tier="host", nbytes=written, buffer=_shrink(buffer, written), **common)
        if tier == "disk":
            owns = path is None
            target = Path(path) if path is not None else _temp_path()
            try:
                snapshot.save(target)
            finally:
                snapshot.release()
            return cls(tier="disk", nbytes=written, path=target, owns_path=owns, **common)
        return snapshot

    @classmethod
    def _capture_device(cls, ctx: Context, seq_id: int, pool: HostPool, common: dict[str, Any]) -> Snapshot:
        size = ctx.seq_state_size(seq_id, STATE_SEQ_FLAGS_ON_DEVICE)
        buffer = pool.acquire(size)
        try:
            written = ctx.seq_state_get(seq_id, buffer.view, STATE_SEQ_FLAGS_ON_DEVICE)
        except BaseException:
            buffer.release()
            raise
        with _device_lock:
            generations = _device_generations.setdefault(ctx, {})
            generation = generations.get(seq_id, 0) + 1
            generations[seq_id] = generation
        return cls(tier="device", nbytes=written, buffer=_shrink(buffer, written), device_ctx=ctx,
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
        """Write the snapshot to ``path`` atomically (temp file, fsync, rename)."""
        self._check_live()
        if self.tier == "device":
            raise SnapshotError("a device-tier snapshot keeps its tensors in the context; capture to the host "
                                "tier to save it")
        if self.tier == "disk":
            loaded = Snapshot.load(self.path, expect=self)
            try:
                return loaded.save(path)
            finally:
                loaded.release()
        assert self._buffer is not None
        target = Path(path)
        header = self._header()
        prefix = _PREFIX.pack(MAGIC, VERSION, len(header))
        digest = hashlib.blake2b(digest_size=_DIGEST)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
        try:
            with os.fdopen(fd, "wb") as fh:
                for part in (prefix[8:], header):
                    digest.update(part)
                fh.write(prefix)
                fh.write(header)
                payload = self._buffer.view
                digest.update(payload)
                fh.write(payload)
                fh.write(digest.digest())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str], pool: HostPool | None = None, *,
             expect: Snapshot | None = None) -> Snapshot:
        """Read and verify a snapshot file into a host-tier snapshot; nothing partial is ever returned."""
        source = Path(path)
        try:
            size = source.stat().st_size
            fh = source.open("rb")
        except OSError as exc:
            raise SnapshotError(f"cannot open snapshot file {source}: {exc}") from exc
        with fh:
            prefix = fh.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise SnapshotCorrupt(f"{source}: {size} bytes is too short for a kvrt snapshot header")
            magic, version, header_len = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise SnapshotCorrupt(f"{source}: not a kvrt snapshot (magic {magic!r}, expected {MAGIC!r})")
            if version != VERSION:
                raise SnapshotCorrupt(f"{source}: snapshot format version {version}, this kvrt reads {VERSION}")
            header_bytes = fh.read(header_len)
            try:
                header = json.loads(header_bytes)
                nbytes = int(header["nbytes"])
            except (ValueError, KeyError, TypeError) as exc:
                raise SnapshotCorrupt(f"{source}: unreadable snapshot header ({exc})") from exc
            expected = _PREFIX.size + header_len + nbytes + _DIGEST
            if size != expected:
                raise SnapshotCorrupt(f"{source}: file is {size} bytes, its header promises {expected} "
                                      f"({nbytes} bytes of state): truncated or extended")
            digest = hashlib.blake2b(prefix[8:], digest_size=_DIGEST)
            digest.update(header_bytes)
            buffer = (pool or default_pool()).acquire(nbytes)
            try:
                view = buffer.view
                for start in range(0, nbytes, _READ_CHUNK):
                    chunk = view[start:start + _READ_CHUNK]
                    if fh.readinto(memoryview(chunk)) != chunk.size:
                        raise SnapshotCorrupt(f"{source}: short read at byte {start} of the state")
                    digest.update(chunk)
                if fh.read(_DIGEST) != digest.digest():
                    raise SnapshotCorrupt(f"{source}: checksum mismatch: the file was altered or damaged")
                snapshot = cls(tier="host", fingerprint=ModelFingerprint(**header["fingerprint"]),
                               layout=StateLayout(**header["layout"]), n_tokens=int(header["n_tokens"]),
                               nbytes=nbytes, tokens_hash=header["tokens_hash"], buffer=buffer)
            except BaseException:
                buffer.release()
                raise
        if expect is not None and (snapshot.fingerprint, snapshot.n_tokens, snapshot.tokens_hash) != (
                expect.fingerprint, expect.n_tokens, expect.tokens_hash):
            snapshot.release()
            raise SnapshotCorrupt(f"{source}: the file now holds a different snapshot than the one captured")
        return snapshot

    # -- lifetime -----------------------------------------------------------------------
    @property
    def pinned(self) -> bool:
        return self._buffer is not None and self._buffer.pinned

    @property
    def released(self) -> bool:
        return self._released

    def _check_live(self) -> None:
        if self._released:
            raise SnapshotError("this snapshot was released")

    def release(self) -> None:
        """Return the host buffer to its pool (and delete a temporary disk file); idempotent."""
        if self._released:
            return
        self._released = True
        if self._buffer is not None:
            self._buffer.release()
        if self._owns_path and self.path is not None:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"Snapshot({self.tier}, {self.n_tokens} tokens, {self.nbytes} bytes, "
                f"model {self.fingerprint.description!r}{', released' if self._released else ''})")


def _shrink(buffer: HostBuffer, written: int) -> HostBuffer:
    """Make the buffer's view exactly the bytes llama.cpp wrote (it may write fewer than it sized)."""
    if written > buffer.nbytes:
        raise SnapshotError(f"llama.cpp wrote {written} bytes into a {buffer.nbytes}-byte buffer")
    buffer.nbytes = written
    return buffer


def _temp_path() -> Path:
    fd, name = tempfile.mkstemp(prefix="kvrt-snapshot-", suffix=".kvs")
    os.close(fd)
    return Path(name)
