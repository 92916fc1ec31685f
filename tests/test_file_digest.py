"""The model fingerprint covers the whole file (cached by file version), and a saved agent is refused, by
name, when its model file changed anywhere (CPU llama.cpp, tiny models)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from kvrt.accounting.ledger import VramLedger
from kvrt.engine.file_digest import CACHE_NAME, hash_file, whole_file_digest
from kvrt.engine.model import Model
from kvrt.serve.batched import BatchConfig, BatchedScheduler
from kvrt.serve.scheduler import Scheduler

MIB = 1 << 20


def flip_byte(path: Path, offset: int) -> None:
    """Change one byte at ``offset`` in place, keeping the size; the mtime moves by the least a write moves it."""
    info = path.stat()
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1))  # a real write moves the mtime on


def test_the_digest_is_of_every_byte_and_cached_by_file_version(tmp_path):
    data = os.urandom(3 * MIB + 17)
    path, cache = tmp_path / "blob.bin", tmp_path / "cache" / CACHE_NAME
    path.write_bytes(data)
    reference = hashlib.blake2b(data, digest_size=16).hexdigest()  # independent: one call over the whole bytes
    assert hash_file(path) == whole_file_digest(path, cache) == reference
    assert str(path) in cache.read_text()
    flip_byte(path, int(1.5 * MIB))  # past the first MiB, before the last: what the old fingerprint never read
    changed = whole_file_digest(path, cache)
    assert changed != reference and changed == hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b'{"x": 5}', b"\xff\xfe", b""])
def test_a_damaged_cache_is_ignored_and_rewritten(tmp_path, damage):
    path, cache = tmp_path / "blob.bin", tmp_path / CACHE_NAME
    path.write_bytes(b"model bytes" * 1000)
    cache.write_bytes(damage)
    assert whole_file_digest(path, cache) == hash_file(path)
    assert whole_file_digest(path, cache) == hash_file(path)
    assert str(path) in cache.read_text()


def test_an_unwritable_cache_costs_a_hash_not_a_failure(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"abc" * 100)
    (tmp_path / "file").write_text("a file where the cache's folder should be")
    assert whole_file_digest(path, tmp_path / "file" / CACHE_NAME) == hash_file(path)


def test_a_stale_cache_entry_is_not_trusted(tmp_path):
    path, cache = tmp_path / "blob.bin", tmp_path / CACHE_NAME
    path.write_bytes(b"first version")
    whole_file_digest(path, cache)
    path.write_bytes(b"other version")  # new mtime and size: another file version
    assert whole_file_digest(path, cache) == hash_file(path)


def test_the_fingerprint_changes_when_the_file_changes_past_its_first_mib(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.setenv("KVRT_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_model_path, copy)
    assert copy.stat().st_size > 2 * MIB + 1  # a byte neither in the first nor in the last MiB exists
    with Model(copy) as model:
        before = model.fingerprint
    flip_byte(copy, copy.stat().st_size // 2)
    with Model(copy) as model:
        after = model.fingerprint
    assert before.mismatch(after) is not None and before.mismatch(after).startswith("content differs")


@pytest.mark.parametrize("mode", ["per-agent", "batched"])
def test_a_saved_agent_is_refused_when_its_model_changed_past_the_first_mib(mode, tmp_path, tiny_model_path,
                                                                           monkeypatch):
    monkeypatch.setenv("KVRT_CACHE_DIR", str(tmp_path / "cache"))
    model, state = tmp_path / "model.gguf", tmp_path / "state"
    shutil.copyfile(tiny_model_path, model)

    def service() -> Scheduler | BatchedScheduler:
        if mode == "per-agent":
            return Scheduler(VramLedger(1 << 30), n_threads=1, state_dir=state)
        return BatchedScheduler(VramLedger(1 << 34), state_dir=state,
                                config=BatchConfig(n_ctx=1024, n_seq_max=2, n_threads=1))

    with service() as sched:
        sched.register("kept", model, 256)
        sched.decode("kept", "some words", 3)
    flip_byte(model, model.stat().st_size // 2)
    with service() as sched:
        assert sched.agents() == [] and sched.state_restored == 0
        [problem] = sched.state_problems
        assert problem.agent_id == "kept" and str(model) in problem.reason and "content differs" in problem.reason
