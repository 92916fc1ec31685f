"""``kvrt.Client``: the daemon's protocol from Python, one connection, typed answers.

A reply's ``ERR`` line becomes :class:`DaemonReplyError` (with its code and fields), so
a ledger refusal arrives as ``exc.code == "VRAM_LEDGER_DENY"`` and
``exc.fields["ledger_max_bytes"]``. One client is one connection; use one per thread
(the daemon serves many connections at once). When the daemon closed the connection and
said why (``ERR IDLE_TIMEOUT``, ``ERR TOO_MANY_CONNECTIONS``), the next request raises
that reply's :class:`DaemonReplyError` rather than a bare broken pipe.

:meth:`Client.stream` is DECODE with ``stream=1``: an iterator over the pieces of text as
the daemon generates them, whose :attr:`TokenStream.result` is the whole reply at the end.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvrt.errors import KvrtError
from kvrt.serve.protocol import END, escape_prompt, parse_fields


class DaemonReplyError(KvrtError):
    """The daemon answered ``ERR CODE …``."""

    def __init__(self, line: str) -> None:
        parts = line.split(" ", 2)
        self.code = parts[1] if len(parts) > 1 else "UNKNOWN"
        self.line = line
        self.fields = parse_fields(line)
        super().__init__(line)


class ConnectionLost(KvrtError):
    """The daemon closed the connection before a whole reply arrived."""


@dataclass(frozen=True)
class Decoded:
    """A DECODE reply: the text and every ``key=value`` the daemon reported."""

    text: str
    fields: dict[str, str]

    @property
    def evicted(self) -> list[str]:
        value = self.fields.get("kv_swap_evicted", "none")
        return [] if value == "none" else value.split(",")

    @property
    def restored(self) -> bool:
        return self.fields.get("kv_swap_restored") == "true"


_OPTIONS = ("temperature", "top_p", "top_k", "seed", "deadline_ms", "stream")


def decode_line(agent_id: str, prompt: str, n_tokens: int, *, stop: Sequence[str] = (), **options: Any) -> str:
    """The DECODE request line: options (``None`` ones left out) before ``--`` when there are any."""
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise KvrtError(f"unknown DECODE option(s) {sorted(unknown)}; known: {', '.join(_OPTIONS)}, stop")
    words = [f"{k}={v}" for k, v in options.items() if v is not None]
    words += [f"stop={json.dumps(s, ensure_ascii=False)}" for s in ([stop] if isinstance(stop, str) else stop)]
    head = " ".join(words) + " -- " if words else ""
    return f"DECODE {agent_id} {n_tokens} {head}{escape_prompt(prompt)}"


class TokenStream:
    """The pieces of one streamed DECODE's text, as the daemon sends them; then :attr:`result`."""

    def __init__(self, client: Client, line: str) -> None:
        self.result: Decoded | None = None
        self._client = client
        client._lock.acquire()
        self._lines: Iterator[str | tuple[str]] | None = client._lines(line)
        self._fields: dict[str, str] = {}
        self._error: str | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._lines is None:
            raise StopIteration
        text = ""
        try:
            for current in self._lines:
                if isinstance(current, tuple):
                    text = current[0]
                elif current.startswith("TOKEN "):
                    return str(parse_fields(current)["text"])
                elif current.startswith("ERR "):
                    self._error = self._error or current
                else:
                    self._fields.update(parse_fields(current))
        except BaseException:
            self._done()
            raise
        self._done()
        if self._error is not None:
            raise DaemonReplyError(self._error)
        self.result = Decoded(text, self._fields)
        raise StopIteration

    def _done(self) -> None:
        if self._lines is not None:
            self._lines = None
            self._client._lock.release()

    def close(self) -> None:
        """Read the rest of the reply (the connection is then free again)."""
        for _ in self:
            pass


class Client:
    """A connection to ``kvrt serve --socket PATH``."""

    def __init__(self, socket_path: str | os.PathLike[str], *, timeout: float | None = None) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(os.fspath(socket_path))
        except OSError as exc:
            self._sock.close()
            raise KvrtError(f"cannot connect to kvrt daemon at {socket_path}: {exc}") from exc
        self._file = self._sock.makefile("rb")
        self._lock = threading.Lock()

    # -- transport ----------------------------------------------------------------------
    def _lines(self, line: str) -> Iterator[str | tuple[str]]:
        """Send one request line; yield the reply's lines as they arrive, its response text as a 1-tuple."""
        if "\n" in line or "\r" in line:
            raise KvrtError("a request is one line; escape newlines in prompts (DECODE does it for you)")
        try:
            self._sock.sendall(line.encode("utf-8") + b"\n")
            unsent = None
        except (BrokenPipeError, ConnectionResetError) as exc:
            unsent = exc  # the daemon closed first; the reason it sent (idle, too many clients) is still readable
        answered = False
        while True:
            try:
                current = self._readline()
            except ConnectionLost:
                if unsent is None:
                    raise
                raise ConnectionLost(f"the daemon closed the connection before this request ({unsent})") from unsent
            if current == END:
                break
            if current.startswith("BEGIN_RESPONSE bytes="):
                size = int(current.split("=", 1)[1])
                body = self._file.read(size + 1)  # the text and the newline that ends it
                if len(body) != size + 1:
                    raise ConnectionLost(f"response text cut short: {len(body) - 1} of {size} bytes")
                if self._readline() != "END_RESPONSE":
                    raise ConnectionLost("response text was not followed by END_RESPONSE")
                yield (body[:size].decode("utf-8"),)
                continue
            answered = answered or current.startswith("ERR ")
            yield current
        if unsent is not None and not answered:  # a whole reply that answered no request of ours
            raise ConnectionLost(f"the daemon closed the connection before this request ({unsent})") from unsent

    def _readline(self) -> str:
        raw = self._file.readline()
        if not raw.endswith(b"\n"):
            raise ConnectionLost("the daemon closed the connection in the middle of a reply")
        return raw[:-1].decode("utf-8")

    def request(self, line: str) -> tuple[list[str], str | None]:
        """Send one request line; returns the reply's lines and its response text (if any)."""
        lines: list[str] = []
        text: str | None = None
        with self._lock:
            for current in self._lines(line):
                if isinstance(current, tuple):
                    text = current[0]
                else:
                    lines.append(current)
        for current in lines:
            if current.startswith("ERR "):
                raise DaemonReplyError(current)
        return lines, text

    def _fields(self, line: str) -> dict[str, Any]:
        lines, _ = self.request(line)
        merged: dict[str, Any] = {}
        for current in lines:
            merged.update(parse_fields(current))
        return merged

    # -- verbs --------------------------------------------------------------------------
    def help(self) -> list[str]:
        return self.request("HELP")[0]

    def status(self) -> dict[str, Any]:
        lines, _ = self.request("STATUS")
        status: dict[str, Any] = {"loaded": [], "devices": [], "state_problems": [], "state_unsaved_agents": []}
        for current in lines:
            fields = parse_fields(current)
            if "model" in fields:
                status["loaded"].append(fields)
            elif "device" in fields:  # kvrt serve --devices: one line per device's ledger
                status["devices"].append(fields)
            elif "state_skipped_agent" in fields:
                status["state_problems"].append(fields)
            elif "state_unsaved_agent" in fields:
                status["state_unsaved_agents"].append(fields)
            else:
                status.update(fields)
        return status

    def list(self) -> list[dict[str, str]]:
        lines, _ = self.request("LIST")
        return [parse_fields(current) for current in lines[1:]]

    def register(self, agent_id: str, model_path: str | os.PathLike[str], n_ctx: int | None = None) -> dict[str, Any]:
        path = os.fspath(model_path)
        if any(c.isspace() for c in path):
            raise KvrtError(f"model path {path!r} contains whitespace, which the line protocol cannot carry")
        return self._fields(f"REGISTER {agent_id} {path}" + (f" {n_ctx}" if n_ctx is not None else ""))

    def unregister(self, agent_id: str) -> None:
        self.request(f"UNREGISTER {agent_id}")

    def decode(self, agent_id: str, prompt: str, n_tokens: int, **options: Any) -> Decoded:
        """DECODE; ``options`` are the protocol's (temperature, top_p, top_k, seed, stop, deadline_ms)."""
        lines, text = self.request(decode_line(agent_id, prompt, n_tokens, **options))
        fields: dict[str, str] = {}
        for current in lines:
            fields.update(parse_fields(current))
        return Decoded(text or "", fields)

    def stream(self, agent_id: str, prompt: str, n_tokens: int, **options: Any) -> TokenStream:
        """DECODE with ``stream=1``: iterate the returned stream for the text as it is generated.

        The connection is busy until the stream is exhausted (or closed, which reads the rest).
        """
        return TokenStream(self, decode_line(agent_id, prompt, n_tokens, stream=1, **options))

    def cancel(self, agent_id: str) -> int:
        """End the agent's running and queued requests; returns how many there were."""
        return int(self._fields(f"CANCEL {agent_id}")["requests"])

    def metrics(self, agent_id: str | None = None) -> dict[str, Any]:
        return self._fields("METRICS" + (f" {agent_id}" if agent_id else ""))

    def fork(self, source_id: str, agent_id: str) -> dict[str, Any]:
        return self._fields(f"FORK {source_id} {agent_id}")

    def close(self) -> None:
        try:
            self._file.close()
        finally:
            self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
