"""Conversion between kvrt snapshots and llama-cpp-python's saved states (``llama_cpp.LlamaState``).

A ``LlamaState`` is what ``Llama.save_state()`` returns, ``Llama.load_state()`` takes and
``LlamaRAMCache`` / ``LlamaDiskCache`` store: llama.cpp's whole-context state
(``llama_state_get_data``), the token ids the context holds (``input_ids[:n_tokens]``,
the array as long as the ``Llama``'s context) and the logits llama-cpp-python kept. A
kvrt :class:`~kvrt.state.snapshot.Snapshot` holds one sequence's state with the model's
fingerprint and a hash of its token ids. llama.cpp writes and parses both byte formats,
so every conversion goes through a scratch context of the snapshot's model and layout:
kvrt never edits state bytes itself.

Invariant: a converted state continues token-identically to its source (greedy, same
settings) while its tokens fit the model's sliding window. Past the window neither side's
restore keeps the prefill's cell layout, so continuations agree up to near-ties: a
kvrt sequence state leaves out the cells the window masks (see
:mod:`kvrt.branching.branches`), and after ``Llama.load_state`` llama.cpp's next cell
search starts at slot 0, where it reuses masked cells (a ``Llama`` reloading its own
state drifts the same way).

What cannot be checked: a ``LlamaState`` names no model. kvrt refuses one whose
vocabulary differs from the model's, and llama.cpp one whose layers or KV widths
differ, but a state of another model with the same shapes would be accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrt.bindings import capture, explain, ffi, lib
from kvrt.checks import shown
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.model import Model
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot, SnapshotError, token_hash

_CELL_ALIGN = 256
_STATE_FIELDS = ("input_ids", "scores", "n_tokens", "llama_state", "llama_state_size", "seed")


class LlamaStateError(SnapshotError):
    """A llama-cpp-python state or a snapshot cannot be converted (what was wrong is named)."""


def _align(n: int) -> int:
    return -(-n // _CELL_ALIGN) * _CELL_ALIGN


def _scratch(model: Model, n_cells: int, flash_attn: str, swa_full: bool) -> Context:
    """A one-sequence context of ``model`` with room for ``n_cells`` cells in the given KV layout."""
    return Context(model, ContextParams(n_ctx=_align(max(n_cells, 1)), n_batch=_CELL_ALIGN, n_ubatch=_CELL_ALIGN,
                                        n_threads=1, flash_attn=flash_attn, swa_full=swa_full))


def _whole_state(ctx: Context) -> bytes:
    """llama.cpp's whole-context state of ``ctx`` (what ``Llama.save_state`` stores)."""
    size = int(lib().llama_state_get_size(ctx.ptr))
    buffer = ffi.new("uint8_t[]", size)
    with capture() as lines:
        written = int(lib().llama_state_get_data(ctx.ptr, buffer, size))
    if written == 0 or written > size:
        raise LlamaStateError(f"llama_state_get_data wrote {written} bytes of a {size}-byte state: "
                              f"{explain(lines, 'llama.cpp logged no reason')}")
    return bytes(ffi.buffer(buffer, written))


def _snapshot_tokens(snapshot: Snapshot, tokens: object) -> list[int]:
    """``tokens`` as ints, checked against the snapshot's length and (where it recorded one) its token hash."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
        raise LlamaStateError(f"tokens must be the snapshot's token ids (a sequence of int), got {shown(tokens)}")
    ids = [int(t) for t in tokens]
    if len(ids) != snapshot.n_tokens:
        raise LlamaStateError(f"{len(ids)} token ids given, the snapshot holds {snapshot.n_tokens} tokens")
    if snapshot.tokens_hash is not None and token_hash(ids) != snapshot.tokens_hash:
        raise LlamaStateError("the token ids given are not the ones the snapshot was captured with (their hash "
                              "differs from the snapshot's)")
    return ids


def _check_llama(llama: object) -> Any:
    """``llama`` if it looks like an open ``llama_cpp.Llama`` (what the conversion reads of it)."""
    for name in ("ctx", "model", "input_ids", "n_vocab"):
        if not hasattr(llama, name):
            raise LlamaStateError(f"expected a llama_cpp.Llama, got {shown(llama)} (it has no {name!r})")
    return llama


def snapshot_to_llama_state(snapshot: Snapshot, llama: Any, tokens: Sequence[int]) -> Any:
    """The ``llama_cpp.LlamaState`` of ``snapshot`` for ``llama``: give it to ``llama.load_state()`` or a cache.

    ``tokens`` are the ids the snapshot holds (llama-cpp-python matches prompts against
    them to reuse the state); they are checked against the snapshot's length and token
    hash. The snapshot is checked against ``llama``'s model (fingerprint) and context
    (KV layout: ``flash_attn``, ``swa_full``, room for its tokens) first; ``llama`` itself
    is not changed. A snapshot holds no logits: the state's ``scores`` is one zero row
    (``Llama.load_state`` broadcasts it), and after ``load_state`` llama-cpp-python
    evaluates at least the prompt's last token again before it samples.
    """
    import llama_cpp

    if not isinstance(snapshot, Snapshot):
        raise LlamaStateError(f"expected a kvrt Snapshot, got {shown(snapshot)}")
    llama = _check_llama(llama)
    ids = _snapshot_tokens(snapshot, tokens)
    target = Context.from_llama_cpp(llama)
    snapshot.check_compatible(target, 0)
    if snapshot.n_tokens > len(llama.input_ids):
        raise LlamaStateError(f"the snapshot holds {snapshot.n_tokens} tokens, the Llama's context "
                              f"{len(llama.input_ids)}")
    with _scratch(target.model, snapshot.n_tokens, target.params.flash_attn, target.params.swa_full) as scratch:
        snapshot.restore(scratch, 0)
        data = _whole_state(scratch)
    input_ids = np.zeros(len(llama.input_ids), dtype=np.intc)
    input_ids[:len(ids)] = ids
    return llama_cpp.LlamaState(input_ids=input_ids, scores=np.zeros((1, llama.n_vocab()), dtype=np.single),
                                n_tokens=len(ids), llama_state=data, llama_state_size=len(data),
                                seed=getattr(llama, "_seed", llama_cpp.LLAMA_DEFAULT_SEED))


def _checked_state(state: object, model: Model) -> tuple[bytes, list[int]]:
    """The state's bytes and token ids, after checking its fields against each other and ``model``."""
    missing = [name for name in _STATE_FIELDS if not hasattr(state, name)]
    if missing:
        raise LlamaStateError(f"expected a llama_cpp.LlamaState, got {shown(state)} (no {missing[0]!r})")
    raw = state.llama_state  # type: ignore[attr-defined]
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise LlamaStateError(f"LlamaState.llama_state must be bytes, got {shown(raw)}")
    data = bytes(raw)
    declared = state.llama_state_size  # type: ignore[attr-defined]
    if len(data) != declared:
        raise LlamaStateError(f"the LlamaState holds {len(data)} bytes of state but its llama_state_size says "
                              f"{declared}: truncated or altered")
    n_tokens = state.n_tokens  # type: ignore[attr-defined]
    input_ids = np.asarray(state.input_ids)  # type: ignore[attr-defined]
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or not 0 < n_tokens <= len(input_ids):
        raise LlamaStateError(f"LlamaState.n_tokens must be in [1, {len(input_ids)}] (its input_ids), got "
                              f"{shown(n_tokens)}")
    scores = np.asarray(state.scores)  # type: ignore[attr-defined]
    if scores.ndim != 2 or scores.shape[1] != model.n_vocab:
        raise LlamaStateError(f"the LlamaState's scores have shape {scores.shape}: a model with a vocabulary of "
                              f"{scores.shape[-1] if scores.ndim else 0} tokens saved it, {model.path.name!r} has "
                              f"{model.n_vocab}")
    return data, [int(t) for t in input_ids[:n_tokens]]


def snapshot_from_llama_state(state: Any, model: Model, *, flash_attn: str = "off",
                              host_pool: HostPool | None = None) -> Snapshot:
    """A host-tier kvrt snapshot of the first ``state.n_tokens`` tokens a ``llama_cpp.LlamaState`` holds.

    ``flash_attn`` must be what the ``Llama`` that saved the state used (``"off"`` is
    ``Llama``'s default ``flash_attn=False``; ``"on"`` for ``flash_attn=True``): it decides
    whether llama.cpp stored V transposed, and the snapshot restores only into contexts
    with the same setting. The state's fields are checked against each other and its
    vocabulary against ``model``'s before llama.cpp parses the bytes; what llama.cpp
    refuses (another model's layers, the other V layout, damaged bytes) is a
    :class:`LlamaStateError` with llama.cpp's own words. Cells past ``n_tokens`` (a
    ``Llama`` leaves them until its next evaluation) are dropped.
    """
    if not isinstance(model, Model):
        raise LlamaStateError(f"expected a kvrt Model, got {shown(model)}")
    if flash_attn not in ("off", "on"):
        raise LlamaStateError(f"flash_attn must be 'off' or 'on' (what the Llama used), got {shown(flash_attn)}")
    data, ids = _checked_state(state, model)
    with _scratch(model, len(state.input_ids), flash_attn, swa_full=True) as ctx:
        buffer = ffi.from_buffer("uint8_t[]", data)
        with capture() as lines:
            read = int(lib().llama_state_set_data(ctx.ptr, buffer, len(data)))
        if read != len(data):
            raise LlamaStateError(
                f"llama.cpp refused the state (read {read} of its {len(data)} bytes: a state of another model, saved "
                f"with flash_attn other than {flash_attn!r}, or damaged): {explain(lines, 'it logged no reason')}")
        ctx.seq_rm(0, len(ids), -1)
        held = ctx.seq_len(0)
        if held != len(ids) or any(seq != 0 for seq in ctx.sequences()):
            raise LlamaStateError(f"the state holds {held} cells of sequence 0 (sequences {sorted(ctx.sequences())}) "
                                  f"but its n_tokens says {len(ids)}")
        first = ctx.seq_pos_min(0)
        if first != 0:
            raise LlamaStateError(f"the state's cells start at position {first}, not 0: its sliding-window cache "
                                  "lost the masked cells (a state restored past the window, or a Llama with "
                                  "swa_full=False), and a kvrt snapshot needs every cell of its prefix")
        return Snapshot.capture(ctx, 0, pool=host_pool, tokens=ids)
