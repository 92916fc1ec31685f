"""Where a snapshot's bytes live: one interface, a host, a device and a disk backend.

``host``
    the full state in a :class:`kvrt.state.hostpool.HostBuffer` (pinned on a GPU machine).
    Restores into any compatible context, any sequence, any number of times.
``device``
    ``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``: the host buffer holds only metadata (cell
    positions, per-layer headers) and llama.cpp copies the tensor rows into a buffer the
    *context* owns, one per source sequence, on the device that holds the KV cache.
    llama.cpp aborts the process (``GGML_ASSERT``) instead of returning an error on
    misuse, so this store refuses first: restore only into the capturing context and
    only the latest device capture of that source sequence (a new capture overwrites
    the copy). Its ``nbytes`` covers the metadata only; it cannot be saved. It works on
    a CPU build too (the "device" is host memory then).
``disk``
    the host bytes in a :mod:`kvrt.state.snapshot_file` file, read back and verified on
    every restore; a temporary file it created is deleted on release.

Invariant: a store never refers to the snapshot that holds it, so a snapshot's finalizer
can release the store when the snapshot is collected.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np

from kvrt.bindings import STATE_SEQ_FLAGS_NONE, STATE_SEQ_FLAGS_ON_DEVICE
from kvrt.engine.context import Context
from kvrt.state.hostpool import HostBuffer, HostPool, default_pool
from kvrt.state.snapshot_file import read_file, temp_path, write_file
from kvrt.state.snapshot_identity import SnapshotError, SnapshotIdentity, SnapshotMismatch

Tier = Literal["host", "device", "disk"]
TIERS: tuple[str, ...] = ("host", "device", "disk")


class SnapshotStore(ABC):
    """The bytes of one sequence's state, in one tier."""

    tier: ClassVar[Tier]

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this store holds for the state (for ``device``: the host metadata only)."""

    @property
    def pinned(self) -> bool:
        return False

    @property
    def path(self) -> Path | None:
        return None

    def check_target(self, ctx: Context) -> None:
        """Raise :class:`SnapshotMismatch` if this store cannot restore into ``ctx`` (the identity is checked apart).

        The default: a store whose bytes any context of the model accepts."""
        return None

    @abstractmethod
    def restore(self, ctx: Context, seq_id: int, identity: SnapshotIdentity) -> None:
        """Put the state into ``seq_id`` of ``ctx`` (already checked against ``identity`` and this store)."""

    @abstractmethod
    def host_bytes(self, identity: SnapshotIdentity) -> AbstractContextManager[np.ndarray]:
        """A context manager giving the whole state as host bytes, to save it elsewhere."""

    @abstractmethod
    def release(self) -> None:
        """Give back what the store holds; runs once (through the snapshot's finalizer)."""


def _capture_buffer(ctx: Context, seq_id: int, pool: HostPool, flags: int) -> HostBuffer:
    """The state of ``seq_id`` (with ``flags``) in a buffer of ``pool`` whose view is exactly what llama.cpp wrote."""
    buffer = pool.acquire(ctx.seq_state_size(seq_id, flags))
    try:
        written = ctx.seq_state_get(seq_id, buffer.view, flags)
        if written > buffer.nbytes:
            raise SnapshotError(f"llama.cpp wrote {written} bytes into a {buffer.nbytes}-byte buffer")
        buffer.nbytes = written  # it may write fewer than it sized
    except BaseException:
        buffer.release()
        raise
    return buffer


class _BufferStore(SnapshotStore):
    """A store whose bytes are one host buffer, restored with ``flags``."""

    flags: ClassVar[int]

    def __init__(self, buffer: HostBuffer) -> None:
        self._buffer = buffer

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @property
    def pinned(self) -> bool:
        return self._buffer.pinned

    def restore(self, ctx: Context, seq_id: int, identity: SnapshotIdentity) -> None:
        ctx.seq_state_set(self._buffer.view, seq_id, self.flags)

    def release(self) -> None:
        self._buffer.release()


class HostStore(_BufferStore):
    """The full state in a host buffer."""

    tier = "host"
    flags = STATE_SEQ_FLAGS_NONE

    @classmethod
    def capture(cls, ctx: Context, seq_id: int, pool: HostPool) -> HostStore:
        return cls(_capture_buffer(ctx, seq_id, pool, cls.flags))

    @contextmanager
    def host_bytes(self, identity: SnapshotIdentity) -> Iterator[np.ndarray]:
        yield self._buffer.view


class DeviceStore(_BufferStore):
    """Metadata on the host, tensor rows in the capturing context's device copy of ``source_seq``."""

    tier = "device"
    flags = STATE_SEQ_FLAGS_ON_DEVICE
    # Which device capture of (context, source sequence) is current: llama.cpp keeps one copy
    # per pair in the context, so every older device store of that pair is stale.
    _current: ClassVar[weakref.WeakKeyDictionary[Context, dict[int, int]]] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, buffer: HostBuffer, ctx: Context, source_seq: int, generation: int) -> None:
        super().__init__(buffer)
        self._ctx = weakref.ref(ctx)
        self.source_seq = source_seq
        self.generation = generation

    @classmethod
    def capture(cls, ctx: Context, seq_id: int, pool: HostPool) -> DeviceStore:
        buffer = _capture_buffer(ctx, seq_id, pool, cls.flags)
        with cls._lock:
            generations = cls._current.setdefault(ctx, {})
            generations[seq_id] = generation = generations.get(seq_id, 0) + 1
        return cls(buffer, ctx, seq_id, generation)

    def check_target(self, ctx: Context) -> None:
        if self._ctx() is not ctx:
            raise SnapshotMismatch("a device-tier snapshot lives in the context that captured it and can only be "
                                   "restored there (capture to the host tier to move state between contexts)")
        with self._lock:
            current = self._current.get(ctx, {}).get(self.source_seq, 0)
        if current != self.generation:
            raise SnapshotMismatch(f"device-tier snapshot of sequence {self.source_seq} is stale: it is capture "
                                   f"#{self.generation} and capture #{current} has overwritten llama.cpp's copy")

    def host_bytes(self, identity: SnapshotIdentity) -> AbstractContextManager[np.ndarray]:
        raise SnapshotError("a device-tier snapshot keeps its tensors in the context; capture to the host "
                            "tier to save it")


class DiskStore(SnapshotStore):
    """The state in a snapshot file; ``owns_path``: a temporary file deleted on release."""

    tier = "disk"

    def __init__(self, path: Path, nbytes: int, *, owns_path: bool) -> None:
        self._path = path
        self._nbytes = nbytes
        self._owns_path = owns_path

    @classmethod
    def write(cls, identity: SnapshotIdentity, host: HostStore, path: Path | None) -> DiskStore:
        """A file of ``host``'s bytes at ``path``, or in a temporary file the store owns."""
        target = temp_path() if path is None else path
        try:
            with host.host_bytes(identity) as payload:
                write_file(target, identity, payload)
        except BaseException:
            if path is None:
                target.unlink(missing_ok=True)
            raise
        return cls(target, host.nbytes, owns_path=path is None)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def path(self) -> Path:
        return self._path

    def restore(self, ctx: Context, seq_id: int, identity: SnapshotIdentity) -> None:
        with self.host_bytes(identity) as payload:
            ctx.seq_state_set(payload, seq_id, STATE_SEQ_FLAGS_NONE)

    @contextmanager
    def host_bytes(self, identity: SnapshotIdentity) -> Iterator[np.ndarray]:
        _, buffer = read_file(self._path, default_pool(), expect=identity)
        try:
            yield buffer.view
        finally:
            buffer.release()

    def release(self) -> None:
        if self._owns_path:
            try:
                self._path.unlink(missing_ok=True)
            except OSError as exc:
                raise SnapshotError(f"cannot delete temporary snapshot file {self._path}: "
                                    f"{exc.strerror or exc}") from exc

