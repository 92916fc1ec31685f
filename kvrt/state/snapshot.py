"""KV snapshots of one sequence: capture once, restore into any compatible context and sequence.

A :class:`Snapshot` is an identity (:class:`kvrt.state.snapshot_identity.SnapshotIdentity`:
the model's fingerprint, the token count and hash, the context parameters that change
the state's layout) plus a store (:mod:`kvrt.state.stores`: host, device or disk) that
holds the bytes of ``llama_state_seq_get_data_ext``. The identity refuses a wrong
restore before llama.cpp parses anything; the store refuses what its tier cannot do.
The size is always asked from llama.cpp (``llama_state_seq_get_size_ext``), never
computed by formula. A restored sequence continues at position ``n_tokens``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path

from kvrt.engine.context import Context
from kvrt.engine.model import ModelFingerprint
from kvrt.state.hostpool import HostPool, default_pool
from kvrt.state.snapshot_file import MAGIC, MAX_HEADER, VERSION, as_path, read_file, write_file
from kvrt.state.snapshot_identity import (
    SnapshotCorrupt,
    SnapshotError,
    SnapshotIdentity,
    SnapshotMismatch,
    StateLayout,
    token_hash,
)
from kvrt.state.stores import TIERS, DeviceStore, DiskStore, HostStore, SnapshotStore, Tier

__all__ = ["MAGIC", "MAX_HEADER", "TIERS", "VERSION", "Snapshot", "SnapshotCorrupt", "SnapshotError",
           "SnapshotIdentity", "SnapshotMismatch", "StateLayout", "Tier", "token_hash"]


class Snapshot:
    """The KV state of one sequence: its identity and the store holding it.

    Release it with :meth:`release` or a ``with`` block; one dropped unreleased gives its
    store back (host buffer, temporary file) when it is collected, or at interpreter exit.
    """

    def __init__(self, identity: SnapshotIdentity, store: SnapshotStore) -> None:
        self.identity = identity
        self.store = store
        self._finalizer = weakref.finalize(self, store.release)

    # identity and storage ---------------------------------------------------------------
    @property
    def fingerprint(self) -> ModelFingerprint:
        return self.identity.fingerprint

    @property
    def layout(self) -> StateLayout:
        return self.identity.layout

    @property
    def n_tokens(self) -> int:
        return self.identity.n_tokens

    @property
    def tokens_hash(self) -> str | None:
        return self.identity.tokens_hash

    @property
    def tier(self) -> Tier:
        return self.store.tier

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    @property
    def path(self) -> Path | None:
        """The file of a disk snapshot (``None`` in the other tiers)."""
        return self.store.path

    @property
    def pinned(self) -> bool:
        return self.store.pinned

    # capture and restore ----------------------------------------------------------------
    @classmethod
    def capture(cls, ctx: Context, seq_id: int = 0, *, tier: Tier = "host", pool: HostPool | None = None,
                tokens: Sequence[int] | None = None, path: str | os.PathLike[str] | None = None) -> Snapshot:
        """Copy the state of ``seq_id`` out of ``ctx`` into a store of ``tier``.

        ``tokens`` (the ids the sequence holds) are checked against its length and
        hashed so a restore can be matched to its text. ``path`` names the file of a
        ``disk`` snapshot (default: a temporary file the snapshot deletes on release).
        """
        if tier not in TIERS:
            raise SnapshotError(f"unknown snapshot tier {tier!r}; choose one of {TIERS}")
        identity = SnapshotIdentity.of(ctx, seq_id, tokens)
        target = as_path(path, "save a snapshot to") if path is not None else None
        pool = pool or default_pool()
        if tier == "device":
            return cls(identity, DeviceStore.capture(ctx, seq_id, pool))
        host = HostStore.capture(ctx, seq_id, pool)
        if tier == "host":
            return cls(identity, host)
        try:
            return cls(identity, DiskStore.write(identity, host, target))
        finally:
            host.release()

    def check_compatible(self, ctx: Context, seq_id: int = 0) -> None:
        """Raise :class:`SnapshotMismatch` naming the first reason ``ctx`` cannot take this state."""
        self._check_live()
        self.identity.check_target(ctx, seq_id)
        self.store.check_target(ctx)

    def restore(self, ctx: Context, seq_id: int = 0) -> None:
        """Replace sequence ``seq_id`` of ``ctx`` with this state (validated first)."""
        self.check_compatible(ctx, seq_id)
        self.store.restore(ctx, seq_id, self.identity)
        held = ctx.seq_len(seq_id)
        if held != self.n_tokens:
            ctx.seq_rm(seq_id)
            raise SnapshotError(f"restore left sequence {seq_id} with {held} tokens instead of {self.n_tokens}")

    # files ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the snapshot to ``path`` atomically (temp file, fsync, rename); returns the path."""
        self._check_live()
        target = as_path(path, "save a snapshot to")
        with self.store.host_bytes(self.identity) as payload:
            return write_file(target, self.identity, payload)

    @classmethod
    def load(cls, path: str | os.PathLike[str], pool: HostPool | None = None) -> Snapshot:
        """Read and verify a snapshot file into a host-tier snapshot; nothing partial is ever returned.

        Every failure is a :class:`SnapshotError` naming the file: :class:`SnapshotCorrupt`
        for contents that are not a whole, unaltered snapshot.
        """
        identity, buffer = read_file(path, pool or default_pool())
        return cls(identity, HostStore(buffer))

    # lifetime ---------------------------------------------------------------------------
    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def _check_live(self) -> None:
        if self.released:
            raise SnapshotError("this snapshot was released")

    def release(self) -> None:
        """Give the store back (host buffer to its pool, temporary file deleted); releasing twice is harmless."""
        self._finalizer()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"Snapshot({self.tier}, {self.n_tokens} tokens, {self.nbytes} bytes, "
                f"model {self.fingerprint.description!r}{', released' if self.released else ''})")
