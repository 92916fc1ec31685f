"""``mypy --strict`` over the installed package layout: ``kvrt``, with ``bindings/`` as ``kvrt.bindings`` and
``kernels/`` as ``kvrt.kernels`` (pyproject's package-dir), which mypy cannot map from the source tree itself.

It builds that layout from symlinks in a temporary directory, runs mypy there with the repository's
``[tool.mypy]`` settings, and prints mypy's report with the repository's paths. Exit status: mypy's.
Usage: ``python tools/typecheck.py`` (CI runs it; extra arguments go to mypy).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"bindings": "bindings", "kernels": "kernels"}  # kvrt.<name> -> repository folder


def build_layout(into: Path) -> None:
    """``into/kvrt``: every entry of ``kvrt/`` linked, plus the mapped subpackages."""
    package = into / "kvrt"
    package.mkdir()
    for entry in (ROOT / "kvrt").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        (package / name).symlink_to(ROOT / folder)
    (into / "kvrt_bench").symlink_to(ROOT / "bench" / "kvrt_bench")  # imported by kvrt bench, not checked


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="kvrt-typecheck-") as tmp:
        build_layout(Path(tmp))
        command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                   "--cache-dir", os.devnull, "-p", "kvrt", *argv]
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
    for name, folder in MAPPED.items():  # report the repository's paths
        done.stdout = done.stdout.replace(f"kvrt/{name}/", f"{folder}/")
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
