"""Snapshots and the host pool, against full recompute on the tiny F32 model (real llama.cpp, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrt.engine.context import Context
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.errors import DecodeError
from kvrt.state.hostpool import PAGE, HostPool, HostPoolError, host_memory, size_class
from kvrt.state.snapshot import Snapshot, SnapshotCorrupt, SnapshotError, SnapshotMismatch, token_hash

TEXT = "The quick brown fox jumps over the lazy dog. " * 6
PROMPT = " In one word, the animal is"


@pytest.fixture(scope="module")
def doc(tiny_model: Model) -> list[int]:
    return tiny_model.tokenize(TEXT)


@pytest.fixture(scope="module")
def prompt(tiny_model: Model) -> list[int]:
    return tiny_model.tokenize(PROMPT, add_special=False)


@pytest.fixture(scope="module")
def reference(tiny_model: Model, doc: list[int], prompt: list[int]) -> np.ndarray:
    """Last-token logits of document + prompt computed from scratch in a fresh context."""
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, doc, logits_last=False)
        return ctx.logits(prefill(ctx, prompt))


@pytest.fixture()
def snapshot(tiny_model: Model, doc: list[int]):
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, doc, logits_last=False)
        snap = Snapshot.capture(ctx, tokens=doc)
    yield snap
    snap.release()


def continue_logits(ctx: Context, prompt: list[int], seq_id: int = 0) -> np.ndarray:
    return ctx.logits(prefill(ctx, prompt, seq_id=seq_id))


def test_restore_into_fresh_context_is_bit_identical_to_recompute(tiny_model, snapshot, doc, prompt, reference):
    with Context(tiny_model, n_ctx=256) as ctx:
        snapshot.restore(ctx)
        assert ctx.seq_len(0) == len(doc) == snapshot.n_tokens  # decoding continues at prefix_len
        np.testing.assert_array_equal(continue_logits(ctx, prompt), reference)


def test_snapshot_metadata_comes_from_the_engine(tiny_model, snapshot, doc):
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, doc, logits_last=False)
        assert snapshot.nbytes == ctx.seq_state_size(0)
    assert snapshot.fingerprint == tiny_model.fingerprint
    assert snapshot.tokens_hash == token_hash(doc)
    assert snapshot.tier == "host"


def test_restore_into_another_sequence_of_a_multi_sequence_context(tiny_model, snapshot, prompt, reference):
    with Context(tiny_model, n_ctx=512, n_seq_max=2, kv_unified=True) as ctx:
        snapshot.restore(ctx, 1)
        assert ctx.seq_len(0) == 0
        np.testing.assert_array_equal(continue_logits(ctx, prompt, seq_id=1), reference)


def test_a_wrong_position_offset_is_caught(tiny_model, snapshot, doc, prompt, reference):
    """RoPE positions come with the state: a wrong offset is refused by llama.cpp, and shifted
    positions change the logits, so the bit-identity test above would catch them too."""
    with Context(tiny_model, n_ctx=256) as ctx:
        snapshot.restore(ctx)
        for wrong in (0, len(doc) + 3):
            with pytest.raises(DecodeError):
                prefill(ctx, prompt, start_pos=wrong)
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, doc, start_pos=5, logits_last=False)
        shifted = continue_logits(ctx, prompt)
    assert not np.array_equal(shifted, reference)


def test_snapshot_of_model_a_is_refused_on_model_b(other_tiny_model_path, snapshot, doc):
    with Model(other_tiny_model_path) as other, Context(other, n_ctx=256) as ctx:
        prefill(ctx, doc[:5], logits_last=False)
        with pytest.raises(SnapshotMismatch, match="content differs"):
            snapshot.restore(ctx)
        assert ctx.seq_len(0) == 5  # refused before llama.cpp saw a byte: nothing changed


def test_context_too_small_is_refused_with_numbers(tiny_model, doc):
    long_doc = doc + doc[1:]
    with Context(tiny_model, n_ctx=512) as ctx:
        prefill(ctx, long_doc, logits_last=False)
        snap = Snapshot.capture(ctx)
    with Context(tiny_model, n_ctx=256) as ctx, snap:
        with pytest.raises(SnapshotMismatch, match=rf"{len(long_doc)} tokens .* only {ctx.n_ctx_seq} cells"):
            snap.restore(ctx)


def test_stream_count_mismatch_is_refused(tiny_model, snapshot):
    """One KV stream per sequence (non-unified) is a different state layout than one shared stream."""
    with Context(tiny_model, n_ctx=512, n_seq_max=2) as ctx:
        with pytest.raises(SnapshotMismatch, match="n_stream=1.*n_stream=2"):
            snapshot.restore(ctx, 1)


def test_layout_mismatch_is_refused(tiny_model, doc):
    with Context(tiny_model, n_ctx=256, flash_attn="off") as ctx:
        prefill(ctx, doc, logits_last=False)
        snap = Snapshot.capture(ctx)
    with Context(tiny_model, n_ctx=256, flash_attn="on") as ctx, snap:
        with pytest.raises(SnapshotMismatch, match="flash_attn"):
            snap.restore(ctx)


def test_capture_checks_the_token_ids_and_refuses_an_empty_sequence(tiny_model, doc):
    with Context(tiny_model, n_ctx=256) as ctx:
        with pytest.raises(SnapshotError, match="holds no tokens"):
            Snapshot.capture(ctx)
        prefill(ctx, doc, logits_last=False)
        with pytest.raises(SnapshotError, match=f"{len(doc) - 1} token ids given"):
            Snapshot.capture(ctx, tokens=doc[:-1])
        with pytest.raises(SnapshotError, match="unknown snapshot tier"):
            Snapshot.capture(ctx, tier="gpu")  # type: ignore[arg-type]


def test_released_snapshot_is_refused(tiny_model, snapshot):
    snapshot.release()
    with Context(tiny_model, n_ctx=256) as ctx, pytest.raises(SnapshotError, match="released"):
        snapshot.restore(ctx)


# -- disk -------------------------------------------------------------------------------
def test_save_load_round_trip_is_bit_identical(tiny_model, snapshot, prompt, reference, tmp_path):
    path = snapshot.save(tmp_path / "doc.kvs")
    assert [p.name for p in tmp_path.iterdir()] == ["doc.kvs"]  # atomic: no temp file left behind
    with Snapshot.load(path) as loaded, Context(tiny_model, n_ctx=256) as ctx:
        assert (loaded.n_tokens, loaded.nbytes, loaded.tokens_hash) == (snapshot.n_tokens, snapshot.nbytes,
                                                                         snapshot.tokens_hash)
        loaded.restore(ctx)
        np.testing.assert_array_equal(continue_logits(ctx, prompt), reference)


def _damaged(path: Path, how: str) -> Path:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "payload-bit":
        data[len(data) // 2] ^= 0x10
    elif how == "header-bit":
        data[20] ^= 0x01
    elif how == "extended":
        data += b"\0"
    elif how == "not-a-snapshot":
        data[:8] = b"GGUFxxxx"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how", ["truncated", "payload-bit", "header-bit", "extended", "not-a-snapshot"])
def test_damaged_file_is_refused_whole(tiny_model, snapshot, doc, tmp_path, how):
    path = _damaged(snapshot.save(tmp_path / "doc.kvs"), how)
    pool = HostPool(pinned=False)
    with pytest.raises(SnapshotCorrupt):
        Snapshot.load(path, pool)
    assert pool.stats.bytes_in_use == 0  # nothing half-loaded is left holding memory


def test_disk_tier_restores_and_deletes_its_temporary_file(tiny_model, doc, prompt, reference):
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, doc, logits_last=False)
        snap = Snapshot.capture(ctx, tier="disk")
    assert snap.tier == "disk" and snap.path.exists()
    with Context(tiny_model, n_ctx=256) as ctx:
        snap.restore(ctx)
        np.testing.assert_array_equal(continue_logits(ctx, prompt), reference)
    snap.release()
    assert not snap.path.exists()


# -- device -----------------------------------------------------------------------------
def test_device_tier_restores_in_its_own_context_only(tiny_model, doc, prompt):
    """A device restore fills the cells a host restore fills, with the same bytes: the logits match bit for bit.

    The reference is a host-tier restore into the same sequence of an identical context (host restores are
    checked against a from-scratch prefill above): a restore into sequence 1 beside sequence 0 lands on other
    cells than a fresh prefill, and a GPU's attention sums in an order that depends on where the cells are.
    """
    params = {"n_ctx": 512, "n_seq_max": 2, "kv_unified": True}
    with Context(tiny_model, **params) as ctx, Context(tiny_model, **params) as other:
        prefill(other, doc, logits_last=False)
        with Snapshot.capture(other) as host:
            host.restore(other, 1)
            host_bytes = host.nbytes
        expected = continue_logits(other, prompt, seq_id=1)
        prefill(ctx, doc, logits_last=False)
        snap = Snapshot.capture(ctx, tier="device")
        assert snap.nbytes < host_bytes  # tensors stayed with the context; only metadata on the host
        snap.restore(ctx, 1)
        np.testing.assert_array_equal(continue_logits(ctx, prompt, seq_id=1), expected)
        with pytest.raises(SnapshotMismatch, match="same context|can only be restored there"):
            snap.restore(other, 0)
        newer = Snapshot.capture(ctx, 0, tier="device")
        with pytest.raises(SnapshotMismatch, match="stale"):
            snap.restore(ctx, 1)
        newer.restore(ctx, 1)
        with pytest.raises(SnapshotError, match="device-tier"):
            newer.save("unused.kvs")


# -- host pool --------------------------------------------------------------------------
@given(st.integers(min_value=1, max_value=1 << 34))
def test_size_class_bounds(nbytes):
    capacity = size_class(nbytes)
    assert capacity % PAGE == 0
    assert nbytes <= capacity <= max(nbytes * 1.125 + PAGE, 8 * PAGE)


def test_host_pool_reuses_buffers_and_aligns_them():
    pool = HostPool(pinned=False)
    first = pool.acquire(10_000)
    assert first.view.nbytes == 10_000 and first.view.flags.writeable and not first.pinned
    assert first.view.ctypes.data % PAGE == 0
    address = first.view.ctypes.data
    first.release()
    first.release()  # idempotent
    with pytest.raises(HostPoolError, match="released"):
        _ = first.view
    second = pool.acquire(9_000)  # same size class
    assert second.view.ctypes.data == address
    assert (pool.stats.allocations, pool.stats.reuses) == (1, 1)
    second.release()
    assert pool.stats.bytes_in_use == 0


def test_host_pool_limits():
    pool = HostPool(pinned=False, max_bytes=64 * PAGE, max_cached_bytes=0)
    held = pool.acquire(40 * PAGE)
    with pytest.raises(HostPoolError, match="max_bytes"):
        pool.acquire(40 * PAGE)
    held.release()
    assert pool.stats.bytes_cached == 0
    pool.acquire(40 * PAGE).release()
    with pytest.raises(HostPoolError, match="positive size"):
        pool.acquire(0)


@pytest.mark.gpu
def test_host_pool_pins_on_a_gpu_machine():
    pool = HostPool(pinned=True)
    buf = pool.acquire(1 << 20)
    assert buf.pinned
    import cupy

    attributes = cupy.cuda.runtime.pointerGetAttributes(buf.view.ctypes.data)
    assert attributes.type == cupy.cuda.runtime.memoryTypeHost
    buf.release()


@pytest.mark.gpu
def test_pinned_memory_is_unpinned_when_let_go_not_parked_in_cupys_pool():
    """A host tier's arena (host_memory) and a trimmed HostPool block are unpinned when dropped: CuPy's own
    pinned pool would keep every block it ever served."""
    import gc

    import cupy

    runtime = cupy.cuda.runtime
    parked = cupy.get_default_pinned_memory_pool().n_free_blocks()
    arena = host_memory(4 << 20)
    arena_ptr = arena.ctypes.data
    assert runtime.pointerGetAttributes(arena_ptr).type == runtime.memoryTypeHost
    pool = HostPool(pinned=True, max_cached_bytes=0)
    buf = pool.acquire(1 << 20)
    buf_ptr = buf.view.ctypes.data
    buf.release()
    assert pool.stats.bytes_cached == 0
    del arena, buf
    gc.collect()
    for ptr in (arena_ptr, buf_ptr):
        assert runtime.pointerGetAttributes(ptr).type != runtime.memoryTypeHost  # unregistered: unpinned
    assert cupy.get_default_pinned_memory_pool().n_free_blocks() == parked


# -- malformed files and unusable paths: SnapshotError naming the path and the reason -------
def _rewrite_header(path: Path, edit) -> Path:
    """Rewrite a saved snapshot with ``edit(header)`` applied and the checksum recomputed (still self-consistent)."""
    import hashlib
    import json
    import struct

    from kvrt.state.snapshot import MAGIC, VERSION

    data = path.read_bytes()
    prefix = struct.Struct("<8sII")
    _, _, header_len = prefix.unpack_from(data)
    header = json.loads(data[prefix.size:prefix.size + header_len])
    payload = data[prefix.size + header_len:-16]
    edit(header)
    body = json.dumps(header).encode()
    head = prefix.pack(MAGIC, VERSION, len(body))
    digest = hashlib.blake2b(head[8:] + body + payload, digest_size=16).digest()
    path.write_bytes(head + body + payload + digest)
    return path


@pytest.mark.parametrize("edit, reason", [
    (lambda h: h.update(extra=1), "unexpected field 'extra'"),
    (lambda h: h.pop("n_tokens"), "missing field 'n_tokens'"),
    (lambda h: h["fingerprint"].update(colour="red"), "fingerprint.*unexpected field 'colour'"),
    (lambda h: h["layout"].pop("swa_full"), "layout.*missing field 'swa_full'"),
    (lambda h: h.update(n_tokens="12"), "n_tokens must be int, got str"),
    (lambda h: h["layout"].update(swa_full=1), "layout.swa_full must be bool, got int"),
    (lambda h: h.update(fingerprint=[1, 2]), "fingerprint must be an object"),
], ids=["extra", "missing", "extra-nested", "missing-nested", "str-for-int", "int-for-bool", "list-for-object"])
def test_a_header_with_wrong_fields_is_refused_naming_the_field(snapshot, tmp_path, edit, reason):
    path = _rewrite_header(snapshot.save(tmp_path / "doc.kvs"), edit)
    pool = HostPool(pinned=False)
    with pytest.raises(SnapshotCorrupt, match=reason) as info:
        Snapshot.load(path, pool)
    assert str(path) in str(info.value)
    assert pool.stats.bytes_in_use == 0


def test_a_header_length_past_the_file_is_refused_as_such(snapshot, tmp_path):
    path = snapshot.save(tmp_path / "doc.kvs")
    data = bytearray(path.read_bytes())
    data[12:16] = (0xFFFFFFF0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=rf"header length 4294967280 .* {len(data)}-byte file") as info:
        Snapshot.load(path)
    assert str(path) in str(info.value) and "codec" not in str(info.value)


def test_a_header_length_past_the_limit_is_refused_even_in_a_large_file(snapshot, tmp_path):
    from kvrt.state.snapshot import MAX_HEADER

    path = snapshot.save(tmp_path / "doc.kvs")
    data = bytearray(path.read_bytes())
    data[12:16] = (MAX_HEADER + 1).to_bytes(4, "little")
    path.write_bytes(bytes(data) + bytes(MAX_HEADER + 1))
    with pytest.raises(SnapshotCorrupt, match=rf"header length {MAX_HEADER + 1} exceeds the limit of {MAX_HEADER}"):
        Snapshot.load(path)


def test_save_into_a_missing_folder_names_the_folder(snapshot, tmp_path):
    target = tmp_path / "nowhere" / "doc.kvs"
    with pytest.raises(SnapshotError, match=rf"{target}.*folder {target.parent} does not exist"):
        snapshot.save(target)


def test_save_onto_a_directory_and_load_of_a_directory_are_snapshot_errors(snapshot, tmp_path):
    with pytest.raises(SnapshotError, match=str(tmp_path)):
        snapshot.save(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the temporary file was removed
    with pytest.raises(SnapshotError, match=rf"{tmp_path}.*not a regular file"):
        Snapshot.load(tmp_path)


def test_load_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(SnapshotError, match=rf"{tmp_path / 'gone.kvs'}.*No such file"):
        Snapshot.load(tmp_path / "gone.kvs")


@pytest.mark.parametrize("bad", [None, 42, b"doc.kvs", "a\0b", "\ud800.kvs"], ids=["none", "int", "bytes", "nul",
                                                                             "lone-surrogate"])
def test_paths_that_are_not_paths_are_refused(snapshot, bad):
    with pytest.raises(SnapshotError, match="path"):
        snapshot.save(bad)
    with pytest.raises(SnapshotError, match="path"):
        Snapshot.load(bad)


def test_disk_capture_into_a_missing_folder_leaves_nothing_behind(tiny_model, doc, tmp_path):
    pool = HostPool(pinned=False)
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, doc, logits_last=False)
        with pytest.raises(SnapshotError, match="does not exist"):
            Snapshot.capture(ctx, tier="disk", pool=pool, path=tmp_path / "nowhere" / "doc.kvs")
    assert pool.stats.bytes_in_use == 0


@pytest.mark.parametrize("bad", [2.5, "4096", None, True], ids=repr)
def test_host_pool_sizes_must_be_integer_byte_counts(bad):
    pool = HostPool(pinned=False)
    with pytest.raises(HostPoolError, match="integer byte count"):
        pool.acquire(bad)
    with pytest.raises(HostPoolError, match="max_bytes"):
        HostPool(pinned=False, max_bytes=bad if bad is not None else -1)
    assert pool.stats.bytes_in_use == 0
