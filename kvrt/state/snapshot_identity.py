"""What a snapshot *is*, apart from where its bytes are: the model, the tokens and the KV layout it fits.

A restore is refused here, before llama.cpp parses anything, when the target context
could not take the state: another model (by fingerprint), too few cells for the
snapshot's tokens, or a KV layout that differs (stream count, V transposition, how
sliding-window layers keep their cells).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvrt.engine.context import Context
from kvrt.engine.model import ModelFingerprint
from kvrt.errors import KvrtError


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


@dataclass(frozen=True)
class SnapshotIdentity:
    """The model, tokens and layout of one sequence's state: what a restore is checked against.

    ``tokens_hash`` is :func:`token_hash` of the ids the sequence held (``None``: not given).
    """

    fingerprint: ModelFingerprint
    layout: StateLayout
    n_tokens: int
    tokens_hash: str | None

    @classmethod
    def of(cls, ctx: Context, seq_id: int, tokens: Sequence[int] | None) -> SnapshotIdentity:
        """The identity of what ``seq_id`` of ``ctx`` holds; refuses an empty or partial sequence."""
        n_tokens = ctx.seq_len(seq_id)
        if n_tokens == 0:
            raise SnapshotError(f"sequence {seq_id} holds no tokens; there is nothing to capture")
        if ctx.seq_pos_min(seq_id) != 0:
            raise SnapshotError(f"sequence {seq_id} starts at position {ctx.seq_pos_min(seq_id)}, not 0: "
                                "a snapshot must hold a whole prefix")
        if tokens is not None and len(tokens) != n_tokens:
            raise SnapshotError(f"{len(tokens)} token ids given but sequence {seq_id} holds {n_tokens} tokens")
        return cls(ctx.model.fingerprint, StateLayout.of(ctx), n_tokens,
                   token_hash(tokens) if tokens is not None else None)

    def same_content(self, other: SnapshotIdentity) -> bool:
        """Whether both describe the same model and tokens (the layout may differ: it is checked on restore)."""
        return (self.fingerprint, self.n_tokens, self.tokens_hash) == (other.fingerprint, other.n_tokens,
                                                                       other.tokens_hash)

    def check_target(self, ctx: Context, seq_id: int) -> None:
        """Raise :class:`SnapshotMismatch` naming the first reason ``seq_id`` of ``ctx`` cannot take this state."""
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
