"""The digest of a whole model file, computed once per version of the file and cached on disk.

A saved agent's KV state is only valid for the exact weights it was computed with, so a
model's fingerprint (:class:`kvrt.engine.model.ModelFingerprint`) covers every byte of
the file: a change anywhere, at the same size, is a different model. Hashing a 15 GB file
takes seconds, so the digest is computed once, in chunks, on a thread started when the
model loads (:class:`FileDigest`), and cached in ``file-digests.json`` of kvrt's cache
directory (:func:`kvrt.system.cpu.cache_dir`), keyed by the file's resolved path, size,
modification time (ns), inode and device: any write, replacement or copy changes the key.
A cache that cannot be read or parsed is ignored (and rewritten); one that cannot be
written costs a hash per process, never a failure. The cache trusts the file system's
metadata: a file rewritten in place with its mtime set back by hand is not noticed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from concurrent.futures import Future
from pathlib import Path

from kvrt._files import write_atomic
from kvrt.errors import ModelLoadError
from kvrt.system.cpu import cache_dir

CACHE_NAME = "file-digests.json"
_CHUNK = 8 << 20
_DIGEST = 16
_lock = threading.Lock()  # one read-modify-write of the cache file at a time in this process
log = logging.getLogger("kvrt.engine.file_digest")


def version_key(path: Path) -> dict[str, int]:
    """What identifies one version of the file at ``path`` (its stat fields; no byte of it is read)."""
    info = path.stat()
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "inode": info.st_ino, "device": info.st_dev}


def hash_file(path: Path) -> str:
    """BLAKE2b-128 of every byte of ``path`` (hex), read in chunks."""
    digest = hashlib.blake2b(digest_size=_DIGEST)
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_cache(cache: Path) -> dict[str, dict[str, object]]:
    try:
        entries = json.loads(cache.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        log.warning("ignoring unreadable model digest cache %s (%s); it is rewritten", cache, exc)
        return {}
    if not isinstance(entries, dict):
        log.warning("ignoring model digest cache %s: not a JSON object; it is rewritten", cache)
        return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict)}


def whole_file_digest(path: Path, cache: Path | None = None) -> str:
    """The digest of every byte of ``path``: from ``cache`` (default: kvrt's cache directory) when its entry
    for the resolved path has the file's current :func:`version_key`, else hashed and stored there."""
    path = path.resolve()
    cache = cache if cache is not None else cache_dir() / CACHE_NAME
    key = version_key(path)
    with _lock:
        entry = _read_cache(cache).get(str(path))
    if entry is not None and entry.get("version") == key and isinstance(entry.get("digest"), str):
        return str(entry["digest"])
    digest = hash_file(path)
    if version_key(path) != key:
        raise OSError(f"{path} changed while it was being hashed")
    with _lock:
        entries = _read_cache(cache)
        entries[str(path)] = {"version": key, "digest": digest}
        data = json.dumps(entries, sort_keys=True, indent=1).encode()
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cache, lambda fh: fh.write(data))
        except OSError as exc:
            log.warning("cannot cache the digest of %s in %s: %s", path, cache, exc)
    return digest


class FileDigest:
    """:func:`whole_file_digest` of one file on a thread of its own, started at once; :meth:`result` waits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._future: Future[str] = Future()
        threading.Thread(target=self._run, name=f"kvrt-digest-{path.name}", daemon=True).start()

    def _run(self) -> None:
        try:
            self._future.set_result(whole_file_digest(self.path))
        except BaseException as exc:
            self._future.set_exception(exc)

    def result(self) -> str:
        """The digest; :class:`ModelLoadError` naming the file when it could not be read."""
        try:
            return self._future.result()
        except OSError as exc:
            raise ModelLoadError("fingerprint", f"cannot hash model file {self.path}: {exc}",
                                 path=str(self.path)) from exc
