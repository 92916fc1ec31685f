"""The daemon's commands: a parsed :class:`kvrt.serve.protocol.Command` in, its reply lines out (no sockets).

Every command runs against one scheduler (per-agent contexts or batched); whatever it
raises becomes one ``ERR`` line through :func:`kvrt.serve.protocol.error_reply`, so a
bad request costs its reply and nothing else.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from kvrt.accounting.budget import Budget
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import KvrtError
from kvrt.serve.protocol import (
    HELP_LINES,
    SCHEMA,
    Command,
    DecodeOptions,
    error_reply,
    ok_line,
    response_block,
    token_line,
)
from kvrt.serve.results import Percentiles
from kvrt.serve.service import AgentService

log = logging.getLogger("kvrt.serve.daemon")


class Handler:
    """Turns parsed commands into reply lines against one scheduler (no sockets here)."""

    def __init__(self, scheduler: AgentService[Any], budget: Budget | None = None,
                 connection_fields: Callable[[], dict[str, Any]] | None = None) -> None:
        self.scheduler = scheduler
        self.budget = budget
        self.connection_fields = connection_fields

    def execute(self, command: Command, stream: Callable[[str], bool] | None = None) -> list[str]:
        """The reply lines to ``command``; ``stream`` (when given) sends a line at once and says whether
        the client is still there: a DECODE with ``stream=1`` sends its TOKEN lines through it."""
        try:
            if command.verb == "DECODE":
                agent_id, n_tokens, prompt, options = command.args
                return self._decode(agent_id, n_tokens, prompt, options, stream)
            lines: list[str] = getattr(self, f"_{command.verb.lower()}")(*command.args)
            return lines
        except Exception as exc:  # a bug must cost one reply, not the daemon
            if not isinstance(exc, KvrtError):
                log.exception("internal error on %s", command.verb)
            return [error_reply(exc)]

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
            ok_line(agents=len(agents), active=sum(a.state == "active" for a in agents),
                    swapped=sum(a.state == "swapped" for a in agents),
                    models=len(self.scheduler.registry.models())),
        ]
        if self.connection_fields is not None:
            lines.append(ok_line(**self.connection_fields()))
        lines += self._state_lines()
        for entry in self.scheduler.registry.models():
            placed = {"placement": entry.placement.describe()} if entry.placement is not None else {}
            lines.append(ok_line(model=entry.path.name, refcount=entry.refcount,
                                 reserved_bytes=entry.reservation.nbytes, estimated_bytes=entry.estimated_bytes,
                                 measured_bytes=entry.measured_bytes, estimate=entry.estimate_source, **placed))
        devices = self.scheduler.registry.devices
        for index, snap in (devices.snapshots() if devices is not None else {}).items():
            lines.append(ok_line(device=index, ledger_max_bytes=snap.max_bytes,
                                 ledger_allocated_bytes=snap.allocated_bytes, ledger_free_bytes=snap.free_bytes,
                                 external_bytes=snap.external_bytes))
        return lines

    def _state_lines(self) -> list[str]:
        """Where agents' state is saved, how many were restored at start, each one skipped and why, and each
        agent whose current state is not saved (a restart would lose or roll it back) and why."""
        store = self.scheduler.store
        if store is None:
            return []
        problems = self.scheduler.state_problems
        unsaved = dict(store.unsaved)
        return [ok_line(state_dir=str(store.directory), state_restored=self.scheduler.state_restored,
                        state_skipped=len(problems), state_unsaved=len(unsaved)),
                *(ok_line(state_skipped_agent=p.agent_id, state_skipped_file=p.file, reason=p.reason)
                  for p in problems),
                *(ok_line(state_unsaved_agent=agent, reason=reason) for agent, reason in sorted(unsaved.items()))]

    def _list(self) -> list[str]:
        agents = self.scheduler.agents()
        return [ok_line(agents=len(agents)), *(
            ok_line(agent=a.agent_id, model=a.model, n_ctx=a.n_ctx, state=a.state, held_tokens=a.held_tokens,
                    context_bytes=a.context_bytes, queued=a.queued, requests=a.requests, policy=a.policy,
                    max_ctx=a.max_ctx)
            for a in agents)]

    def _register(self, agent_id: str, model_path: str, n_ctx: int, policy: str, min_ctx: int | None,
                  keep: int | None) -> list[str]:
        info = self.scheduler.register(agent_id, model_path, n_ctx, policy=policy, min_ctx=min_ctx, keep=keep)
        return [ok_line("registered", agent=agent_id, model=info.model, n_ctx=info.n_ctx,
                        weights_bytes=info.weights_bytes, context_bytes=info.context_bytes,
                        estimate=info.estimate, policy=info.policy, max_ctx=info.max_ctx)]

    def _unregister(self, agent_id: str) -> list[str]:
        self.scheduler.unregister(agent_id)
        return [ok_line("unregistered", agent=agent_id)]

    def _decode(self, agent_id: str, n_tokens: int, prompt: str, options: DecodeOptions,
                stream: Callable[[str], bool] | None = None) -> list[str]:
        chosen = {k: getattr(options, k) for k in ("temperature", "top_p", "top_k", "seed")
                  if getattr(options, k) is not None}
        deadline = time.monotonic() + options.deadline_ms / 1e3 if options.deadline_ms is not None else None
        pieces: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        future = self.scheduler.submit(agent_id, prompt, n_tokens, sampling=SamplingParams(**chosen),
                                       stop=options.stop, deadline=deadline,
                                       on_text=pieces.put if options.stream and stream else None)
        if options.stream and stream is not None:
            future.add_done_callback(lambda _: pieces.put(None))
            client = True
            while (piece := pieces.get()) is not None:
                client = client and stream(token_line(piece))  # a client gone stops the copy, not the turn
        result = future.result()
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
            *self._saved_line(result.unsaved),
            *response_block(result.text),
        ]

    def _saved_line(self, unsaved: str | None) -> list[str]:
        """With a state dir, whether the agent's state after the turn was saved (``state_error``: why not)."""
        if self.scheduler.store is None:
            return []
        return [ok_line(state_saved=unsaved is None, **({"state_error": unsaved} if unsaved else {}))]

    def _metrics(self, agent_id: str | None = None) -> list[str]:
        stats = self.scheduler.metrics(agent_id)
        fields: dict[str, Any] = {}
        for name, value in vars(stats).items():
            if isinstance(value, Percentiles):
                fields.update({f"{name[:-3]}_{pct}_ms": v for pct, v in vars(value).items()})
            else:
                fields[name] = value
        return [ok_line(agent=agent_id or "all", **fields)]

    def _cancel(self, agent_id: str) -> list[str]:
        return [ok_line("cancelled", agent=agent_id, requests=self.scheduler.cancel(agent_id))]

    def _fork(self, source_id: str, agent_id: str) -> list[str]:
        info = self.scheduler.fork(source_id, agent_id)
        return [ok_line("forked", agent=agent_id, source=source_id, held_tokens=info.held_tokens)]

    def _quit(self) -> list[str]:
        return [ok_line("bye")]
