"""Snapshots and host buffers dropped without release() give their memory and files back.

A dropped object is collected (CPython frees it at once; ``gc.collect()`` covers a cycle)
and its ``weakref.finalize`` returns the buffer to its pool and deletes a temporary
disk file; the same finalizers run at interpreter exit.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from kvrt.engine.context import Context
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.state.hostpool import PAGE, HostPool, size_class
from kvrt.state.snapshot import Snapshot

TEXT = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def filled(tiny_model: Model):
    """A context whose sequence 0 holds a short document."""
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, tiny_model.tokenize(TEXT), logits_last=False)
        yield ctx


def test_dropped_host_buffers_go_back_to_the_pool():
    pool = HostPool(pinned=False, max_bytes=48 * PAGE)
    for _ in range(100):
        pool.acquire(PAGE)  # dropped at once, never released
    gc.collect()
    assert pool.stats.bytes_in_use == 0
    assert pool.stats.allocations == 1  # every later lease reused the first buffer


def test_dropped_snapshots_do_not_exhaust_a_bounded_pool(filled):
    size = size_class(filled.seq_state_size(0))
    pool = HostPool(pinned=False, max_bytes=48 * size)
    for _ in range(100):
        Snapshot.capture(filled, pool=pool)  # the 49th would be refused if drops leaked
    gc.collect()
    assert pool.stats.bytes_in_use == 0


def test_dropped_disk_snapshots_delete_their_temporary_files(filled, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for _ in range(200):
        Snapshot.capture(filled, tier="disk")
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_a_named_disk_snapshot_keeps_its_file_when_dropped(filled, tmp_path):
    path = tmp_path / "kept.kvs"
    Snapshot.capture(filled, tier="disk", path=path)
    gc.collect()
    assert path.is_file()


def test_with_blocks_release_snapshots_and_buffers(filled, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pool = HostPool(pinned=False)
    with Snapshot.capture(filled, pool=pool) as snap:
        assert pool.stats.bytes_in_use > 0
    assert snap.released and pool.stats.bytes_in_use == 0
    with Snapshot.capture(filled, tier="disk") as disk:
        assert disk.path.is_file()
    assert disk.released and list(tmp_path.iterdir()) == []
    with pool.acquire(PAGE) as buffer:
        assert pool.stats.bytes_in_use == PAGE
    assert buffer.released and pool.stats.bytes_in_use == 0


def test_releasing_twice_and_then_dropping_returns_the_buffer_once(filled):
    pool = HostPool(pinned=False)
    snap = Snapshot.capture(filled, pool=pool)
    snap.release()
    snap.release()
    del snap
    gc.collect()
    stats = pool.stats
    assert stats.bytes_in_use == 0
    assert stats.bytes_cached == size_class(filled.seq_state_size(0))  # cached once, not twice


def test_a_buffer_collected_while_its_pool_is_busy_does_not_deadlock():
    """A collection can run a finalizer on a thread that holds the pool's lock (inside acquire):
    giving the buffer back must not wait for that lock."""
    pool = HostPool(pinned=False)
    done = threading.Event()

    def drop_under_the_lock() -> None:
        buffer = pool.acquire(PAGE)
        cycle = [buffer]
        cycle.append(cycle)  # only the cyclic collector frees it
        del buffer, cycle
        with pool._lock:
            gc.collect()
        done.set()

    worker = threading.Thread(target=drop_under_the_lock, daemon=True)
    worker.start()
    worker.join(60)  # a deadlock guard, not a timing assertion
    assert done.is_set(), "the finalizer blocked on the pool's lock"
    assert pool.stats.bytes_in_use == 0


def test_temporary_disk_snapshots_are_deleted_at_interpreter_exit(tiny_model_path, tmp_path):
    """A disk snapshot still referenced when the interpreter exits deletes its file too."""
    script = (
        "import sys, tempfile\n"
        "tempfile.tempdir = sys.argv[2]\n"
        "from kvrt.engine.context import Context\n"
        "from kvrt.engine.generation import prefill\n"
        "from kvrt.engine.model import Model\n"
        "from kvrt.state.snapshot import Snapshot\n"
        "model = Model(sys.argv[1])\n"
        "ctx = Context(model, n_ctx=256)\n"
        "prefill(ctx, model.tokenize('hello world'), logits_last=False)\n"
        "kept = Snapshot.capture(ctx, tier='disk')\n"
        "print(kept.path)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tiny_model_path), str(tmp_path)],
                          capture_output=True, text=True, check=True)
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.parent == tmp_path and path.name.startswith("kvrt-snapshot-")
    assert not path.exists()
