"""Helpers the tests of kvrt's servers share: one JSON call over HTTP, a `kvrt serve` process started and waited for,
the socket daemon tests' context size."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

WAIT_S = 120.0
N_CTX = 256  # cells of each agent's context in the socket daemon's tests (the ``daemon`` fixture's ledger holds one)


def http_call(address: str, method: str, path: str, body: Any = None,
              headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """``method path`` at ``address`` ("host:port") with ``body`` as JSON: the status and the decoded answer."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    try:
        connection.request(method, path, None if body is None else json.dumps(body),
                           {"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def turn_body(model: str, prompt: list[int], max_tokens: int, *, user: str | None = None,
              stream: bool = False) -> dict[str, Any]:
    """A greedy completions body for one agent turn that answers with its tokens (and, streamed, its usage)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_tokens": True, "stream": stream}
    if user is not None:
        body["user"] = user
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@contextmanager
def serving(argv: Sequence[str], env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    """``kvrt serve`` with ``--http`` started from ``argv``: the process, its HTTP address and what it printed up to
    the line naming that address (the socket front's line comes first when it has one; the test fails with its
    stderr when no address comes); killed at the end if it still runs."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: list[str] = []
        found = None
        while found is None and len(lines) < 3 and proc.stdout is not None:
            lines.append(proc.stdout.readline())
            found = re.search(r"http://([^/\s]+)/v1", lines[-1])
            if not lines[-1]:
                break
        if found is None:
            proc.kill()
            pytest.fail(f"kvrt serve printed {lines!r}; stderr: {proc.communicate(timeout=WAIT_S)[1][-2000:]}")
        yield proc, found.group(1), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
