"""Files replaced whole or not at all, surviving a crash or a power cut at any instant.

:func:`write_atomic` writes a temporary file in the target's directory, fsyncs it,
renames it over the target (``os.replace``: atomic on POSIX) and fsyncs the directory,
so after a crash the target holds either its old contents or its new ones, never a
mixture, and a completed call survives a power cut. Temporary files are named
``.<target name>.<random>`` + :data:`TEMP_SUFFIX`, so a directory's owner can recognise
and remove those a crash left behind (:func:`remove_temporaries`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".partial"


def fsync_directory(directory: Path) -> None:
    """Make a rename or an unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace ``target`` with what ``write`` writes to a file object (see the module docstring).

    Any exception (an ``OSError`` from the file system included) leaves ``target`` as it
    was and no temporary file behind.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def remove_temporaries(directory: Path) -> list[str]:
    """Delete the temporary files an interrupted :func:`write_atomic` left in ``directory``; their names."""
    removed = []
    for path in directory.glob(f".*{TEMP_SUFFIX}"):
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
