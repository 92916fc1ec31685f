"""Agents of the HTTP front: who a request speaks for, and (with ``--state-dir``) their turns saved and brought back.

Identity: a request names its agent by the ``X-Kvrt-Agent`` header or the body's ``user``
(OpenAI's field: chat, completions, responses, and kvrt's fork); the header wins when both
are given. An id is what the socket daemon takes (:func:`kvrt.serve.results.check_agent_id`:
1..64 characters of ``[A-Za-z0-9_.:@-]``, so it is also a safe file name); anything else is a
400 naming the field. No id: the request is anonymous, as before. An id never seen starts fresh.

Between turns the engine keeps an agent's history (:attr:`kvrt.runtime.requests.Request.agent`):
its requests are admitted round robin with other agents', the slot its turn leaves is its own,
evicted after anonymous prefixes and never cut short by another agent's request, and once
evicted its host copy outlives anonymous ones. Its next turn, whose prompt starts with its
history, reuses all of it (see :mod:`kvrt.runtime.prefix_cache`).

Saved (:class:`AgentBook` with a state dir, ``DIR/http``, an :class:`kvrt.state.agentstore.AgentStore`:
its lock refuses a second process): as an agent's turn ends, on the engine's thread and before
the turn's end is streamed, ``Request.at_end`` copies its slot's KV state (exactly the tokens
the slot holds: prompt and output but the last sampled token) into a host
:class:`kvrt.state.snapshot.Snapshot`; the HTTP handler then saves it with its transcript on a
worker thread (KV file, then the manifest naming it: atomic and fsynced, the KV bound by
checksum and token hash to the manifest, the model by its whole-file fingerprint) and only
then answers: the body of a non-streamed request, the last chunks (usage, ``[DONE]``) of a
streamed one. A turn whose answer a client has read is on disk. A save that fails is logged
and kept in ``unsaved`` (``/v1/kvrt/stats``; ``kvrt serve`` exits 1); the answer still goes out.

Restored: at start every manifest is read and its KV file verified against it and against the
model served from its model path (same fingerprint: at start for a model loaded then, on the
agent's first request for one loaded on demand); one that fails (damaged, another model now,
a model this server does not serve) is a :class:`kvrt.state.agentstore.StateProblem`, logged,
listed in ``/v1/kvrt/stats`` and skipped: that agent starts fresh, the others come back. A
verified agent's KV is read again and put into its engine's host tier
(:meth:`kvrt.runtime.batching.Engine.preload`): at start, in the background, for the models
loaded then, until the tier is full (:meth:`AgentBook.prefetch`); else on its first request,
before the request is queued. Either way that turn
restores its whole history instead of prefilling it, and its output is the one a server that
never stopped gives (same KV, same computation of the rest). Where the engine cannot take the
state (another KV layout, no host tier) the turn prefills its transcript instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvrt.engine.context import Context
from kvrt.errors import KvrtError
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import EngineClosed
from kvrt.serve.api_error import ApiError
from kvrt.serve.results import check_agent_id
from kvrt.serve.statedir import check_model
from kvrt.state.agentstore import AgentRecord, AgentStore, StateFileError, StateProblem
from kvrt.state.snapshot import Snapshot, SnapshotError

HEADER = "X-Kvrt-Agent"
SUBDIR = "http"  # the HTTP front's agents in DIR/http: the socket front may use DIR itself in the same process
log = logging.getLogger("kvrt.serve.http_agents")


def agent_of(header: str | None, user: Any) -> str | None:
    """The agent a request names (the header, else the body's ``user``), or None; a 400 naming the field when the
    id is not one (see the module docstring)."""
    given, field = (header, HEADER) if header is not None else (user, "user")
    if given is None:
        return None
    try:
        return check_agent_id(given)
    except KvrtError as exc:
        raise ApiError(400, f"{field}: {exc}", param=field, code="invalid_agent_id") from None


class Turn:
    """One agent request's turn: the engine hands its KV to :meth:`capture`, the book saves it (:meth:`AgentBook.save`).

    Invariant: ``snapshot`` holds the KV state of exactly ``tokens`` (or is None: not handed over)."""

    def __init__(self, agent: str, engine: Engine) -> None:
        self.agent, self.engine = agent, engine
        self.snapshot: Snapshot | None = None
        self.tokens: tuple[int, ...] = ()

    def capture(self, ctx: Context, slot: int, tokens: tuple[int, ...]) -> None:
        """``Request.at_end``: copy the slot's state out (engine thread)."""
        self.snapshot = Snapshot.capture(ctx, slot, tokens=tokens)
        self.tokens = tokens

    def release(self) -> None:
        if self.snapshot is not None:
            self.snapshot.release()
            self.snapshot = None


class AgentBook:
    """The HTTP front's agents in a state directory (None: identities only, nothing saved); see the module docstring.

    Opening refuses (:class:`kvrt.state.agentstore.AgentStoreError`) a directory another process holds, before
    any model is loaded; :meth:`verify` then reads the saved agents against the server's engines.
    """

    def __init__(self, state_dir: str | Path | None = None) -> None:
        self.store = AgentStore(Path(state_dir) / SUBDIR) if state_dir is not None else None
        self.problems: list[StateProblem] = []
        self.saved_turns = 0
        self._waiting: dict[str, tuple[AgentRecord, str]] = {}  # verified, KV not yet put into their model's engine
        self._turns: dict[str, Turn] = {}  # request stream id -> the turn saved as it ends (event loop only)
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closing = False
        self.prefetching: Future[int] | None = None  # agents put into host memory at start (prefetch), once done

    @property
    def unsaved(self) -> dict[str, str]:
        """Agents whose last save failed, with why."""
        return dict(self.store.unsaved) if self.store is not None else {}

    def describe(self) -> dict[str, Any]:
        """What ``/v1/kvrt/stats`` shows of the agents' state dir."""
        return {"state_dir": str(self.store.directory) if self.store is not None else None,
                "waiting_to_restore": len(self._waiting), "prefetched": self._prefetched(),
                "saved_turns": self.saved_turns,
                "problems": [{"agent": p.agent_id, "file": p.file, "reason": p.reason} for p in self.problems],
                "unsaved": self.unsaved}

    def _prefetched(self) -> int:
        """How many agents the start's prefetch put into host memory (0 while it runs, or when there was none)."""
        done = self.prefetching
        return done.result() if done is not None and done.done() else 0

    def turn(self, agent: str | None, engine: Engine, n: int = 1) -> Turn | None:
        """A turn to save for ``agent``'s request of ``n`` choices (None: anonymous, ``n`` > 1: no one history to
        keep, or nothing is saved)."""
        return Turn(agent, engine) if agent is not None and n == 1 and self.store is not None else None

    # -- restore ------------------------------------------------------------------------
    def verify(self, models: Mapping[str, Path], loaded: Mapping[str, Engine]) -> None:
        """Read every saved agent and verify its files (see the module docstring); each that fails is a problem.
        ``models``: every model the server serves, name -> file (a saved agent belongs to the model whose file it
        was saved with); ``loaded``: those loaded now, whose fingerprint is checked at once (a model loaded on
        demand later is checked on the agent's first request)."""
        if self.store is None:
            return
        by_path = {path.resolve(): name for name, path in models.items()}
        records, problems = self.store.load()
        for record in records:
            try:
                name = by_path.get(Path(record.model_path).resolve())
                if name is None:
                    raise StateFileError(record.manifest_name, f"agent {record.agent_id!r} was saved with model "
                                                               f"{record.model_path}, which this server does not serve")
                if name in loaded:
                    check_model(record, loaded[name].model)
                snapshot = self.store.load_snapshot(record)
            except (KvrtError, OSError) as exc:
                problems.append(StateProblem(record.agent_id, getattr(exc, "file", record.manifest_name), str(exc)))
                continue
            if snapshot is not None:
                snapshot.release()
                self._waiting[record.agent_id] = (record, name)
        self._note(problems)
        log.info("HTTP agents in %s: %d to restore, %d not restored", self.store.directory, len(self._waiting),
                 len(problems))

    def _note(self, problems: list[StateProblem]) -> None:
        for problem in problems:
            log.warning("saved agent %r not restored (%s): %s", problem.agent_id, problem.file, problem.reason)
        with self._lock:
            self.problems.extend(problems)

    def restoring(self, agent: str | None) -> bool:
        """Whether ``agent`` has a saved history still waiting to be restored, so its request needs :meth:`prepare`
        (a look at one dict, for the event loop: most requests have none and skip the hop to a worker thread)."""
        return agent is not None and agent in self._waiting

    def prepare(self, agent: str | None, model: str, engine: Engine) -> bool:
        """Before ``agent``'s request to ``model`` (served by ``engine``) is queued (a worker thread, blocking): its
        saved KV, if it waits to be restored and was saved with that model, into the engine's host tier; whether
        this call put it there. A failure now is a problem of that agent (its turn prefills); an engine closing
        meanwhile leaves it waiting."""
        if agent is None or not self.restoring(agent):
            return False
        with self._lock:
            lock = self._locks.setdefault(agent, threading.Lock())
        with lock:  # a second request of the agent waits for the first one's restore
            waiting = self._waiting.get(agent)
            if waiting is None or waiting[1] != model:  # its history is another model's: it waits for that one
                return False
            record = waiting[0]
            try:
                check_model(record, engine.model)
                self._restore(record, engine)
            except EngineClosed:
                raise
            except (KvrtError, OSError) as exc:
                self._note([StateProblem(agent, getattr(exc, "file", record.manifest_name), str(exc))])
                del self._waiting[agent]
                return False
            del self._waiting[agent]
            return True

    def prefetch(self, loaded: Mapping[str, Engine]) -> Future[int]:
        """Put every waiting agent whose model is loaded now into that model's host tier, on a thread of its own,
        instead of on each agent's first request (which then only restores it from host memory, not from disk):
        the future says how many were put. An agent whose request comes first does it itself (one lock an agent);
        a model unloaded meanwhile leaves its agents waiting; :meth:`close` stops it between agents. It stops
        putting agents into an engine whose host tier has dropped an entry since it began: the tier is full, and
        more would only push out the ones it put (those left wait for their first request, as before)."""
        done: Future[int] = Future()
        self.prefetching = done
        waiting = [(agent, name) for agent, (_, name) in list(self._waiting.items()) if name in loaded]

        def run() -> None:
            put = 0
            dropped: dict[str, int] = {}  # model -> its host tier's drops when the prefetch began
            try:
                for agent, name in waiting:
                    engine = loaded.get(name)
                    if self._closing or engine is None:
                        continue
                    drops = engine.stats().host_dropped
                    if dropped.setdefault(name, drops) != drops:
                        continue
                    try:
                        put += self.prepare(agent, name, engine)
                    except EngineClosed:
                        continue
            finally:
                done.set_result(put)

        threading.Thread(target=run, name="kvrt-agents-prefetch", daemon=True).start()
        return done

    def _restore(self, record: AgentRecord, engine: Engine) -> None:
        assert self.store is not None
        snapshot = self.store.load_snapshot(record)
        if snapshot is None:
            return
        try:
            def fits(ctx: Context) -> None:
                snapshot.identity.check_target(ctx, 0)

            with snapshot.store.host_bytes(snapshot.identity) as payload:
                kept = engine.preload(record.transcript[:record.n_tokens], payload, owner=record.agent_id,
                                      check=fits).result()
        finally:
            snapshot.release()
        if not kept:
            raise StateFileError(record.manifest_name, f"agent {record.agent_id!r}: its engine has no host tier room "
                                                       f"for its {snapshot.nbytes} bytes of KV; its turn prefills")
        log.info("agent %r: %d tokens of history restored", record.agent_id, record.n_tokens)

    # -- save ---------------------------------------------------------------------------
    def track(self, stream_id: str, turn: Turn | None) -> None:
        """``turn`` (if any) is request ``stream_id``'s: :meth:`finish` or :meth:`drop` ends it."""
        if turn is not None:
            self._turns[stream_id] = turn

    async def finish(self, stream_id: str) -> None:
        """Request ``stream_id`` ended well: save its turn, if it is an agent's, on a worker thread (awaited: the
        answer goes out after)."""
        turn = self._turns.pop(stream_id, None)
        if turn is not None:
            await asyncio.to_thread(self.save, turn)

    def drop(self, stream_id: str) -> None:
        """Request ``stream_id`` ended otherwise (an error, cancelled, the client gone): nothing is saved, the
        previous save stays."""
        turn = self._turns.pop(stream_id, None)
        if turn is not None:
            turn.release()

    def save(self, turn: Turn) -> None:
        """Save a finished turn (a worker thread, blocking; see the module docstring); a failure is logged and kept
        in :attr:`unsaved` by the store."""
        assert self.store is not None
        try:
            if turn.snapshot is None:  # ended by its deadline, or the copy failed (the engine logged why)
                log.warning("agent %r: this turn's KV state was not handed over; its previous save stays (a "
                            "restart prefills what its next prompt adds to it)", turn.agent)
                return
            model = turn.engine.model
            record = AgentRecord(turn.agent, str(model.path), model.fingerprint, turn.engine.n_cells,
                                 len(turn.tokens), len(turn.tokens), turn.tokens)
            with self._lock:
                lock = self._locks.setdefault(turn.agent, threading.Lock())
            with lock:
                self.store.save(record, turn.snapshot)
            with self._lock:
                self.saved_turns += 1
        except (KvrtError, SnapshotError):
            pass  # the store logged it and keeps it in unsaved
        finally:
            turn.release()

    def close(self) -> None:
        """Release the state dir's lock (a prefetch under way stops after the agent it is at)."""
        self._closing = True
        if self.store is not None:
            self.store.close()
