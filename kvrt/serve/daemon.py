"""``kvrt serve``: one process owns the GPU and speaks lmxd's protocol on a Unix socket.

Many clients at once (a thread per connection; the scheduler serialises device work
and keeps it fair, or batches it), requests answered by :class:`kvrt.serve.handler.Handler`
in :mod:`kvrt.serve.protocol`'s form, and a bad line from one client gets an ``ERR`` line
without touching anyone else's state.

The socket is created owner-only (0600) inside a directory that is checked first (it
must exist, belong to us or root, and not be writable by others unless sticky like
``/tmp``). A socket file left by a crashed daemon is detected (nobody answers a connect)
and replaced; a live one is refused. :meth:`Daemon.stop` is the clean shutdown that
SIGTERM triggers: stop accepting, let the running request finish, answer queued ones
with ``ERR SHUTTING_DOWN``, then close every connection and remove the socket; replies
are sent whole, never half-written. Stopping is bounded: a request still running when
its timeout ends is abandoned, and ``stop`` says so.

Connections are bounded in number and idle time (:class:`Daemon`), each refusal an
``ERR`` line the client can read before the daemon closes; the listen backlog is the
system's maximum, so a burst of clients connecting at once is queued, not refused.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrt.accounting.budget import Budget
from kvrt.errors import KvrtError
from kvrt.serve.handler import Handler
from kvrt.serve.protocol import (
    MAX_LINE,
    ProtocolError,
    error_line,
    line_too_long,
    parse_line,
    reply,
)
from kvrt.serve.service import AgentService

log = logging.getLogger("kvrt.serve.daemon")


class DaemonError(KvrtError):
    """The daemon cannot start on this socket path."""


def check_socket_path(path: str | os.PathLike[str]) -> Path:
    """Validate ``path``'s directory and clear a stale socket; returns the absolute path."""
    target = Path(path).absolute()
    if len(os.fsencode(target)) >= 108:
        raise DaemonError(f"socket path {target} is {len(os.fsencode(target))} bytes; Unix sockets allow 107")
    directory = target.parent
    try:
        info = directory.stat()
    except FileNotFoundError:
        raise DaemonError(f"socket directory {directory} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise DaemonError(f"{directory} is not a directory")
    if info.st_uid not in (os.getuid(), 0):
        raise DaemonError(f"socket directory {directory} belongs to uid {info.st_uid}, not to us ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise DaemonError(f"socket directory {directory} is writable by others (mode {stat.S_IMODE(info.st_mode):o}) "
                          "and not sticky: another user could replace the socket")
    if target.exists() or target.is_symlink():
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise DaemonError(f"{target} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(target))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise DaemonError(f"cannot tell whether {target} is live: {exc}") from exc
            log.warning("removing stale socket %s (no daemon answers on it)", target)
            target.unlink(missing_ok=True)
        else:
            raise DaemonError(f"another daemon is already serving on {target}")
        finally:
            probe.close()
    return target


DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_IDLE_TIMEOUT_S = 300.0
DEFAULT_STOP_TIMEOUT_S = 30.0
_REFUSAL_SEND_S = 1.0  # a refused client's ERR line goes into a fresh socket buffer; never wait long on it
_REPLY_GRACE_S = 1.0  # after the scheduler closed, time for the last replies to be written whole


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A thread per admitted connection; ``admit`` runs on the accept thread, so a refusal costs no thread."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = False
    request_queue_size = socket.SOMAXCONN  # the default 5 made clients connecting at once see EAGAIN

    def __init__(self, path: str, handler: type[socketserver.BaseRequestHandler],
                 admit: Callable[[socket.socket], bool]) -> None:
        self.admit = admit
        super().__init__(path, handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.admit(request)


def _read_line(rfile: Any) -> bytes | None:
    """The next request line with its newline, or ``None`` once the client has gone.

    A line longer than :data:`MAX_LINE` (newline included) is skipped to its end and
    refused with its length; a client that leaves in the middle of a line gets no answer.
    """
    raw: bytes = rfile.readline(MAX_LINE)
    if raw.endswith(b"\n"):
        return raw
    if len(raw) < MAX_LINE:
        return None
    length = len(raw)
    while raw and not raw.endswith(b"\n"):
        raw = rfile.readline(MAX_LINE)
        length += len(raw)
    raise ProtocolError("LINE_TOO_LONG", line_too_long(length + (not raw.endswith(b"\n"))))


class Daemon:
    """The socket server around a :class:`Handler`; :meth:`start` then :meth:`stop`.

    At most ``max_connections`` clients are served at once (one thread each); a client
    past that gets ``ERR TOO_MANY_CONNECTIONS`` and is closed. A connection that sends
    nothing for ``idle_timeout_s`` seconds (``None``: never) gets ``ERR IDLE_TIMEOUT`` and
    is closed; the same timeout bounds sending a reply to a client that does not read.
    """

    def __init__(self, socket_path: str | os.PathLike[str], scheduler: AgentService[Any], *,
                 budget: Budget | None = None, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S) -> None:
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise DaemonError(f"max_connections must be a positive integer, got {max_connections!r}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise DaemonError(f"idle_timeout_s must be positive (or None for no limit), got {idle_timeout_s!r}")
        self.path = check_socket_path(socket_path)
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.handler = Handler(scheduler, budget, self._connection_fields)
        self.scheduler = scheduler
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._clean = True
        daemon = self

        class _Connection(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                daemon._serve_connection(self.connection, self.rfile, self.wfile)

        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            self._server = _Server(str(self.path), _Connection, self._admit)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvrt-daemon-accept", daemon=True)

    def start(self) -> Daemon:
        self._thread.start()
        log.info("serving on %s", self.path)
        return self

    def _connection_fields(self) -> dict[str, Any]:
        with self._lock:
            open_now = len(self._connections)
        return {"connections": open_now, "max_connections": self.max_connections,
                "idle_timeout_s": self.idle_timeout_s}

    def _admit(self, conn: socket.socket) -> bool:
        """Count ``conn`` in (accept thread), or tell it why not; the caller closes a refused one."""
        with self._lock:
            if self._stopping.is_set():
                refusal = error_line("SHUTTING_DOWN", "the daemon is shutting down")
            elif len(self._connections) >= self.max_connections:
                refusal = error_line("TOO_MANY_CONNECTIONS",
                                     f"max_connections={self.max_connections} all {self.max_connections} connections "
                                     "are in use; close one or retry later")
            else:
                self._connections.add(conn)
                return True
        log.info("refused a connection: %s", refusal)
        try:
            conn.settimeout(_REFUSAL_SEND_S)
            conn.sendall(reply(refusal))
        except OSError:
            pass  # the client is gone already
        return False

    def _idle_notice(self) -> str:
        t = self.idle_timeout_s
        return error_line("IDLE_TIMEOUT", f"idle_timeout_s={t:g} no request for {t:g} s; closing this connection")

    def _serve_connection(self, conn: socket.socket, rfile: Any, wfile: Any) -> None:
        with self._lock:
            self._threads.add(threading.current_thread())
        try:
            conn.settimeout(self.idle_timeout_s)
            while not self._stopping.is_set():
                command = None
                try:
                    raw = _read_line(rfile)
                    if raw is None:
                        return
                    command = parse_line(raw)
                except TimeoutError:
                    self._send(wfile, [self._idle_notice()])
                    return
                except ProtocolError as exc:
                    lines = [exc.reply()]
                else:
                    lines = self.handler.execute(command, lambda line: self._send(wfile, [line], end=False))
                if not self._send(wfile, lines) or (command is not None and command.verb == "QUIT"):
                    return
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())

    @staticmethod
    def _send(wfile: Any, lines: list[str], *, end: bool = True) -> bool:
        """Send one whole reply (``end=False``: lines of one still to come); False when the client has gone
        (or stopped reading past the idle timeout)."""
        try:
            wfile.write(reply(*lines) if end else "".join(f"{line}\n" for line in lines).encode("utf-8"))
            wfile.flush()
        except OSError:
            return False  # the request still ran; only its reply is lost
        return True

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
        """Stop accepting, finish or refuse what is in flight, close connections, remove the socket.

        Bounded by ``timeout`` seconds: queued requests are refused at once and the
        running one gets what is left. Returns False when it was still running then; it
        is abandoned to its thread, and its agent's state is neither freed nor saved
        (freeing memory under a running llama.cpp call would crash the process).
        """
        with self._lock:
            if self._stopping.is_set():
                return self._clean
            self._stopping.set()
        deadline = time.monotonic() + timeout
        if self._thread.is_alive():
            self._server.shutdown()
        with self._lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RD)  # idle readers wake up; pending replies can still be written
                except OSError:
                    pass
            threads = list(self._threads)
        self._clean = self.scheduler.close(timeout=max(deadline - time.monotonic(), 0.0))
        replies_by = max(deadline, time.monotonic() + _REPLY_GRACE_S)
        for thread in threads:
            thread.join(max(replies_by - time.monotonic(), 0.0))
        self._server.server_close()
        self.path.unlink(missing_ok=True)
        if self._clean:
            log.info("stopped; removed %s", self.path)
        else:
            log.warning("stopped after %.3g s with a request still running (abandoned); removed %s", timeout, self.path)
        return self._clean

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
