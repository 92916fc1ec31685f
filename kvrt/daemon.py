"""``kvrt serve``: one process owns the GPU and speaks lmxd's protocol on a Unix socket.

Many clients at once (a thread per connection; the scheduler serialises device work
and keeps it fair), requests answered in :mod:`kvrt.protocol`'s form, and a bad line
from one client gets an ``ERR`` line without touching anyone else's state.

The socket is created owner-only (0600) inside a directory that is checked first (it
must exist, belong to us or root, and not be writable by others unless sticky like
``/tmp``). A socket file left by a crashed daemon is detected (nobody answers a connect)
and replaced; a live one is refused. :meth:`Daemon.stop` is the clean shutdown that
SIGTERM triggers: stop accepting, let the running request finish, answer queued ones
with ``ERR SHUTTING_DOWN``, then close every connection and remove the socket; replies
are sent whole, never half-written.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import socketserver
import stat
import threading
from pathlib import Path
from typing import Any

from kvrt.budget import Budget
from kvrt.errors import ContextError, KvrtError, ModelLoadError
from kvrt.estimate import EstimateError
from kvrt.ledger import LedgerDenied
from kvrt.protocol import (HELP_LINES, MAX_LINE, SCHEMA, Command, ProtocolError, error_line, ok_line, parse_line,
                           reply, response_block)
from kvrt.scheduler import Scheduler, SchedulerError

log = logging.getLogger("kvrt.daemon")
_JOIN_S = 30.0


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


class Handler:
    """Turns parsed commands into reply lines against one scheduler (no sockets here)."""

    def __init__(self, scheduler: Scheduler, budget: Budget | None = None) -> None:
        self.scheduler = scheduler
        self.budget = budget

    def execute(self, command: Command) -> list[str]:
        try:
            return getattr(self, f"_{command.verb.lower()}")(*command.args)
        except LedgerDenied as exc:
            return [exc.reply()]
        except (ProtocolError, SchedulerError) as exc:
            return [error_line(exc.code, str(exc))]
        except (ModelLoadError, EstimateError) as exc:
            return [error_line("MODEL_LOAD", str(exc))]
        except ContextError as exc:
            return [error_line("CONTEXT", str(exc))]
        except KvrtError as exc:
            return [error_line("FAILED", str(exc))]
        except Exception as exc:  # a bug must cost one reply, not the daemon
            log.exception("internal error on %s", command.verb)
            return [error_line("INTERNAL", f"{type(exc).__name__}: {exc}")]

    def _help(self) -> list[str]:
        return [ok_line(schema=SCHEMA), *(f"OK {line}" for line in HELP_LINES)]

    def _status(self) -> list[str]:
        ledger = self.scheduler.ledger.reconcile()
        agents = self.scheduler.agents()
        device = ledger.device
        lines = [
            ok_line(schema=SCHEMA),
            ok_line(ledger_max_bytes=ledger.max_bytes, ledger_allocated_bytes=ledger.allocated_bytes,
                    ledger_free_bytes=ledger.free_bytes, external_bytes=ledger.external_bytes,
                    admit_percent=self.scheduler.ledger.admit_percent,
                    ledger_source=self.budget.source if self.budget else None,
                    ledger_share_percent=self.budget.share_percent if self.budget else None),
            ok_line(nvml_total_bytes=device.total_bytes if device else None,
                    nvml_used_bytes=device.used_bytes if device else None,
                    drift_bytes=ledger.drift_bytes, reconciliations=ledger.reconciliations),
            ok_line(agents=len(agents), active=sum(a["state"] == "active" for a in agents),
                    swapped=sum(a["state"] == "swapped" for a in agents),
                    models=len(self.scheduler.registry.models())),
        ]
        for entry in self.scheduler.registry.models():
            lines.append(ok_line(model=entry.path.name, refcount=entry.refcount,
                                 reserved_bytes=entry.reservation.nbytes, estimated_bytes=entry.estimated_bytes,
                                 measured_bytes=entry.measured_bytes, estimate=entry.estimate_source))
        return lines

    def _list(self) -> list[str]:
        agents = self.scheduler.agents()
        return [ok_line(agents=len(agents)), *(
            ok_line(agent=a["agent_id"], model=a["model"], n_ctx=a["n_ctx"], state=a["state"],
                    context_bytes=a["context_bytes"], queued=a["queued"], requests=a["requests"])
            for a in agents)]

    def _register(self, agent_id: str, model_path: str, n_ctx: int) -> list[str]:
        info = self.scheduler.register(agent_id, model_path, n_ctx)
        return [ok_line("registered", agent=agent_id, model=info["model"], n_ctx=n_ctx,
                        weights_bytes=info["weights_bytes"], context_bytes=info["context_bytes"],
                        estimate=info["estimate"])]

    def _unregister(self, agent_id: str) -> list[str]:
        self.scheduler.unregister(agent_id)
        return [ok_line("unregistered", agent=agent_id)]

    def _decode(self, agent_id: str, n_tokens: int, prompt: str) -> list[str]:
        result = self.scheduler.decode(agent_id, prompt, n_tokens)
        m = result.metrics
        return [
            ok_line(schema=SCHEMA),
            ok_line(call="DECODE", agent_id=agent_id),
            ok_line(prompt_tokens=m.prompt_tokens, generated_tokens=m.generated_tokens,
                    stop_on_eos=result.finish_reason == "eog", finish_reason=result.finish_reason),
            ok_line(elapsed_ms=m.latency_ms, queue_wait_ms=m.queue_wait_ms, decode_ms=m.decode_ms),
            ok_line(kv_swap_evicted=",".join(result.evicted) or "none", kv_swap_restored=result.restored,
                    swap_out_bytes=m.swap_out_bytes, swap_out_ms=m.swap_out_ms,
                    swap_in_bytes=m.swap_in_bytes, swap_in_ms=m.swap_in_ms),
            *response_block(result.text),
        ]

    def _metrics(self, agent_id: str | None = None) -> list[str]:
        stats = self.scheduler.metrics(agent_id)
        fields: dict[str, Any] = {k: v for k, v in stats.items() if not isinstance(v, dict)}
        for name in ("latency_ms", "queue_wait_ms", "swap_in_ms", "decode_ms"):
            for pct, value in stats[name].items():
                fields[f"{name[:-3]}_{pct}_ms"] = value
        return [ok_line(agent=agent_id or "all", **fields)]

    def _fork(self, source_id: str, agent_id: str) -> list[str]:
        info = self.scheduler.fork(source_id, agent_id)
        return [ok_line("forked", agent=agent_id, source=source_id, held_tokens=info["held_tokens"])]

    def _quit(self) -> list[str]:
        return [ok_line("bye")]


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False


class Daemon:
    """The socket server around a :class:`Handler`; :meth:`start` then :meth:`stop`."""

    def __init__(self, socket_path: str | os.PathLike[str], scheduler: Scheduler, *,
                 budget: Budget | None = None) -> None:
        self.path = check_socket_path(socket_path)
        self.handler = Handler(scheduler, budget)
        self.scheduler = scheduler
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        daemon = self

        class _Connection(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                daemon._serve_connection(self.connection, self.rfile, self.wfile)

        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            self._server = _Server(str(self.path), _Connection)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvrt-daemon-accept", daemon=True)

    def start(self) -> Daemon:
        self._thread.start()
        log.info("serving on %s", self.path)
        return self

    def _serve_connection(self, conn: socket.socket, rfile: Any, wfile: Any) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self._connections.add(conn)
            self._threads.add(threading.current_thread())
        try:
            while not self._stopping.is_set():
                raw = rfile.readline(MAX_LINE + 1)
                if not raw:
                    return
                if not raw.endswith(b"\n"):
                    if len(raw) <= MAX_LINE:
                        return  # the client went away in the middle of a line: nothing to answer
                    while raw and not raw.endswith(b"\n"):  # skip the rest of an over-long line
                        raw = rfile.readline(MAX_LINE + 1)
                    lines = [error_line("LINE_TOO_LONG", f"request line exceeds {MAX_LINE} bytes")]
                    command = None
                else:
                    try:
                        command = parse_line(raw)
                        lines = self.handler.execute(command)
                    except ProtocolError as exc:
                        command, lines = None, [exc.reply()]
                try:
                    wfile.write(reply(*lines))
                    wfile.flush()
                except OSError:
                    return  # the client disconnected before its reply: its request still ran
                if command is not None and command.verb == "QUIT":
                    return
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())

    def stop(self) -> None:
        """Stop accepting, finish or refuse what is in flight, close connections, remove the socket."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._thread.is_alive():
            self._server.shutdown()
        with self._lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RD)  # idle readers wake up; pending replies can still be written
                except OSError:
                    pass
            threads = list(self._threads)
        self.scheduler.close()
        for thread in threads:
            thread.join(_JOIN_S)
        self._server.server_close()
        self.path.unlink(missing_ok=True)
        log.info("stopped; removed %s", self.path)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
