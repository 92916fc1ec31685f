"""The parts the soaks share: what they watch in the server process they drive (resident memory and open file
descriptors, from /proc) and how they report.

Used by ``tools/soak_daemon.py`` and ``tools/soak_http.py`` (each runs as a script, so this
directory is first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def rss_bytes(pid: int) -> int | None:
    """The process's resident set size, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    """How many file descriptors the process holds open, or None once it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


@dataclass
class Watch:
    """Samples a process's RSS and open fds every ``every_s`` seconds on a thread, until :meth:`stop`."""

    pid: int
    every_s: float = 1.0
    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Watch:
        threading.Thread(target=self._run, name="soak-watch", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            rss, fds = rss_bytes(self.pid), open_fds(self.pid)
            if rss is not None and fds is not None:
                self.rss.append(rss)
                self.fds.append(fds)

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict[str, object]:
        """Min/max and the first and second halves' maxima of each series; ``rss_bounded``: the second half's RSS
        peak stays within 25 % + 32 MiB of the first half's (no growth the run would keep feeding)."""
        half = len(self.rss) // 2
        first, last = max(self.rss[:half], default=0), max(self.rss[half:], default=0)
        return {
            "samples": len(self.rss),
            "rss_mib": {"min": round(min(self.rss, default=0) / 2**20, 1),
                        "max": round(max(self.rss, default=0) / 2**20, 1),
                        "first_half_max": round(first / 2**20, 1), "last_half_max": round(last / 2**20, 1)},
            "rss_bounded": last <= first * 1.25 + (32 << 20),
            "open_fds": {"first": self.fds[0] if self.fds else None, "last": self.fds[-1] if self.fds else None,
                         "max": max(self.fds, default=None)},
        }


def run_clients(loop: Callable[[int, float], None], clients: int, duration_s: float) -> float:
    """Run ``loop(index, until)`` on ``clients`` threads until the monotonic time ``until``, ``duration_s`` from
    now; the seconds until the last one returned (each finishes the request it is in)."""
    started = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i, started + duration_s)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - started


def report(summary: dict[str, object], ok: bool, out: str | None) -> int:
    """Print the JSON summary (with ``ok``), also to ``out`` when given; the exit status: 0 when ``ok``."""
    summary["ok"] = ok
    text = json.dumps(summary, indent=2, ensure_ascii=False)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0 if ok else 1
