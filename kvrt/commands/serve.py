"""``kvrt serve``: one owner of the GPU for many agents, on a Unix socket (lmxd's protocol), over HTTP (OpenAI's API),
or both from one process: one VRAM ledger and one model registry under both fronts, so a model both use is loaded
and charged once, and what the HTTP front's engines hold counts against the cap the socket's agents are admitted to.

Unix socket: try it with ``nc -U PATH`` (send HELP). The ledger's cap is ``--admit-percent`` of the
GPU's memory as NVML reports it; on a machine without one, a stated share of host RAM
(:mod:`kvrt.accounting.budget`), unless ``--capacity-bytes`` fixes it. ``--devices SPEC`` admits against one ledger per
device instead (:mod:`kvrt.accounting.devices`): each model placed by :mod:`kvrt.accounting.placement` and charged to
its device(s); the socket front then needs ``--batch-slots``.

SIGTERM or Ctrl-C shuts down cleanly and within ``--shutdown-timeout-s``: the running
request finishes, queued ones get ``ERR SHUTTING_DOWN``, agents are saved (with
``--state-dir``), the socket file is removed, exit status 0. A request still running at
the timeout is abandoned (exit status 1); a second signal during shutdown exits at once
(status 1). With ``--state-dir`` every agent is saved as each of its turns completes and a
restarted daemon brings every saved agent back, after a crash too; an agent whose state
could not be saved (a full or read-only state dir) is named in the log and the exit
status is 1.
HTTP: see :mod:`kvrt.commands._http`; its models are admitted by the same ledger (a ``--model`` that does not fit
is refused at start with the ledger's numbers; a ``--models-dir`` model loaded on demand may unload idle HTTP
models, never a socket agent's weights: the registry frees a model only when its last lease goes). SIGTERM or
Ctrl-C stops accepting, ends open requests (streams get a
final error event and ``[DONE]``), closes the engines and exits 0, within ``--shutdown-timeout-s`` (else exit status
1); a second signal exits at once (status 1). With both fronts the HTTP front stops first, then the socket's.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrt.accounting.budget import Budget
    from kvrt.accounting.devices import DeviceLedgers
    from kvrt.accounting.ledger import VramLedger
    from kvrt.serve.daemon import Daemon
    from kvrt.serve.http_front import HttpFront
    from kvrt.serve.registry import ModelRegistry

from kvrt.commands import _http
from kvrt.commands._args import env_defaults, seconds
from kvrt.errors import KvrtError

HELP = "serve agents over a Unix socket (lmxd's protocol), over HTTP (OpenAI's API), or both"
DESCRIPTION = """--socket PATH: agents registered by name, each with its KV state kept (on the GPU, or
swapped to pinned host memory while others run), admitted against a VRAM ledger; a text
protocol, one line a request (connect with nc -U PATH and send HELP).

""" + _http.DESCRIPTION
_SIGNAL_POLL_S = 0.2
log = logging.getLogger("kvrt.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvrt.runtime.admission import KV_LAYOUTS
    from kvrt.serve.daemon import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, DEFAULT_STOP_TIMEOUT_S

    where = parser.add_argument_group("where to listen (either or both: one process, one ledger)")
    where.add_argument("--socket", default=None, help="Unix socket path (created 0600)")
    where.add_argument("--http", metavar="HOST:PORT", default=None,
                       help="serve OpenAI's HTTP API at this address (port 0: any free port)")
    parser.add_argument("--capacity-bytes", type=int, default=None,
                        help="fixed ledger cap in bytes (default: the GPU's memory, or half the host RAM "
                             "where NVML sees no GPU)")
    parser.add_argument("--admit-percent", type=float, default=90.0, help="cap as a percent of GPU memory")
    parser.add_argument("--devices", metavar="SPEC", default=None,
                        help="admit against one ledger per device and place each model by free memory (a model "
                             "larger than any one device is split over several by layer, tensor_split proportional "
                             "to their free memory); SPEC: " + _devices_help() + ". The socket front needs "
                             "--batch-slots with it; --replicas puts copies of each HTTP model on several. "
                             "Without --devices: one ledger (--capacity-bytes or the GPU)")
    parser.add_argument("--vram-table", default=None, help="lmxd model_vram table overriding derived estimates")
    parser.add_argument("--reconcile-s", type=float, default=5.0, help="re-read NVML every this many seconds")
    parser.add_argument("--charge", choices=("measured", "estimated"), default="measured",
                        help="on a GPU, charge each model load and context what it took of the device's free memory "
                             "(measured) or the header's estimate (estimated: other processes allocating on the "
                             "same GPU are then never counted as kvrt's)")
    parser.add_argument("--n-gpu-layers", type=int, default=-1, help="layers to offload (-1: all)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per context")
    parser.add_argument("--state-dir", default=None,
                        help="keep agents across restarts: their state is saved here (on swap-out and at shutdown) "
                             "and restored at start (with --batch-slots: registrations and transcripts, the KV "
                             "recomputed on each agent's first turn); --http: agents named by X-Kvrt-Agent or user "
                             "are saved in DIR/http (KV and transcript) before each turn is answered, and restored on "
                             "each agent's first turn after a restart")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                        help="per-agent contexts: restore the agent queued next while the current one decodes "
                             "(--no-prefetch: every swap-in is a synchronous restore at the start of its turn)")
    parser.add_argument("--batch-slots", type=int, default=0,
                        help="decode each model's agents together in one batch per step, up to this many turns at "
                             "once, in one shared context of --batch-cells cells (0: one context per agent, swapped)")
    parser.add_argument("--batch-cells", type=int, default=8192, help="cells of a model's shared batch context")
    parser.add_argument("--batch-host-mib", type=int, default=2048,  # BatchConfig.host_bytes
                        help="host memory for copies of agents' histories evicted from the batch context, restored "
                             "when the agent returns instead of prefilled again (0: recompute them)")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default="auto",
                        help="a shared context's KV cells (--batch-slots, --http): split gives each slot a stream of "
                             "cells / slots, so a sequence attends over its own history only (llama-server's default); "
                             "unified pools them, so one request may use them all and prefixes are shared without a "
                             "copy, but every sequence attends over every used cell; auto runs split and turns unified "
                             "while a request needs more than a slot's share")
    parser.add_argument("--pad-gaps", choices=("on", "off"), default="on",
                        help="split layout: a step whose sequences leave slots between them gives each idle one a "
                             "throwaway token, removed after the step, and each prefilling one the budget left out a "
                             "token of its prompt, when that makes fewer llama.cpp micro-batches (each reads all the "
                             "weights; llama.cpp puts only consecutive slots in one) without costing more attention "
                             "than the weight passes it saves")
    parser.add_argument("--even-chunks", choices=("on", "off"), default="on",
                        help="split layout: a step whose prompt chunks come out of different lengths (the token "
                             "budget cut the last one short, or a prompt ends inside its chunk) gives every chunk a "
                             "shorter one's length, or leaves the last to the next step, when that makes fewer or "
                             "fuller llama.cpp micro-batches (it gives each sequence of one the same number of tokens)")
    parser.add_argument("--decode-wait-s", type=seconds(zero=True), default=0.5,
                        help="split layout: while prompt chunks fill whole steps, decoding requests sit out the steps "
                             "that come less than this long after one that decoded them, since decode rows beside "
                             "prompt chunks cost llama.cpp a pass over all the weights of their own; their tokens "
                             "then come this far apart while others' prompts are computed (0: decode every step)")
    parser.add_argument("--hold-s", type=seconds(zero=True), default=0.1,  # EngineConfig.hold_s
                        help="with more agents than slots: a slot whose request just finished is held at least this "
                             "long for that conversation's next turn, longer (up to 1 s) where next turns are seen to "
                             "take longer to come back; a queued next turn is placed ahead of requests that would "
                             "evict its history (at most a slot count of them, then nothing is held from a waiting "
                             "request), so the turn finds its history in place instead of prefilling it again (0: no "
                             "hold)")
    parser.add_argument("--backend-sampling", choices=("on", "off"), default="off",
                        help="greedy requests without logprobs get their next token picked inside llama.cpp's "
                             "decode graph (llama.cpp's backend sampling), so no row of logits (4 bytes a vocabulary "
                             "entry) is copied out and scanned on the host for them; other requests as before")
    parser.add_argument("--host-write-behind", choices=("on", "off"), default="on",
                        help="with a host tier: while nothing runs or waits, cached histories are copied to the host "
                             "tier's free room, so the request that later evicts one does not wait for its copy")
    parser.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",  # EngineConfig.warmup
                        help="before serving, decode a micro-batch of throwaway tokens and one in every slot, so "
                             "llama.cpp's first use of its kernels (loaded on first launch by a GPU build) does not "
                             "fall on the first requests (auto: where the model's layers are on a GPU)")
    parser.add_argument("--gil-switch-s", type=seconds(zero=False), default=sys.getswitchinterval(),
                        help="the longest a Python thread holds the GIL while another waits for it "
                             "(sys.setswitchinterval): every GIL release the engine's thread makes (a NumPy pass, a "
                             "llama.cpp call) may cost it this long while HTTP threads parse or stream")
    parser.add_argument("--argmax-threads", type=int, default=None,
                        help="threads a decode step's greedy picks are split among (1: one NumPy call on the engine's "
                             "thread, one GIL hand-off; default: half the CPUs, at most 8)")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="clients served at once; more get ERR TOO_MANY_CONNECTIONS")
    parser.add_argument("--idle-timeout-s", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                        help="close a connection silent this long, with ERR IDLE_TIMEOUT (0: never)")
    parser.add_argument("--shutdown-timeout-s", type=seconds(zero=True), default=DEFAULT_STOP_TIMEOUT_S,
                        help="on SIGTERM, wait at most this long for the running request")
    _http.add_http_arguments(parser)
    env_defaults(parser)  # last: every option above


def run(args: argparse.Namespace) -> int:
    if args.socket is None and args.http is None:
        raise KvrtError("kvrt serve needs --socket PATH (kvrt's protocol), --http HOST:PORT (OpenAI's API), or both "
                        "(one process, one ledger)")
    accounts = Accounts.of(args)
    budget, ledger, devices, registry = accounts.budget, accounts.ledger, accounts.devices, accounts.registry
    signals = _Signals()
    fronts = _Fronts()
    try:
        if args.socket:
            fronts.daemon = _start_socket(args, registry, budget)
            caps = (", ".join(f"device {i} max {devices.ledger(i).max_bytes} B" for i in devices.indices)
                    if devices is not None else f"ledger max {ledger.max_bytes} B")
            print(f"kvrt serve: listening on {fronts.daemon.path} ({caps} from {budget.source}: {budget.reason})",
                  flush=True)
        if args.http:
            fronts.http = _http.start_http(args, registry)
            host, port = fronts.http.address
            pool = fronts.http.pool
            waiting = [name for name in pool.names() if not pool.is_loaded(name)]
            print(f"kvrt serve: http://{host}:{port}/v1 serving {', '.join(pool.engines) or 'no model yet'}"
                  + (f" (on demand: {', '.join(waiting)})" if waiting else "")
                  + f" on {fronts.http.server.runs_on}", flush=True)
        signals.wait_for_first()
    except BaseException:
        fronts.stop(args.shutdown_timeout_s)
        accounts.close()
        raise
    if not _stop_within(fronts, args.shutdown_timeout_s, signals):
        _exit_now(1)  # a request is still inside llama.cpp: freeing models or tearing down Python under it could crash
    accounts.close()
    unsaved = fronts.unsaved()
    for agent, reason in sorted(unsaved.items()):
        log.error("agent %r is not saved: %s", agent, reason)
    if unsaved:
        log.error("stopped with %d agent(s) whose state is not saved in %s (exit status 1): a restart loses or "
                  "rolls them back", len(unsaved), args.state_dir)
    return 1 if unsaved else 0


def _devices_help() -> str:
    from kvrt.accounting.devices import SPEC_HELP

    return SPEC_HELP


@dataclass(frozen=True)
class Accounts:
    """What every front of one ``kvrt serve`` process shares: the budget, the ledger (the first device's under
    ``--devices``, whose ledgers are ``devices``) and the model registry charging it."""

    budget: Budget
    ledger: VramLedger
    devices: DeviceLedgers | None
    registry: ModelRegistry

    @classmethod
    def of(cls, args: argparse.Namespace) -> Accounts:
        """``kvrt serve``'s from its parsed options, with the process-wide settings they name made first (the GIL
        switch interval, the argmax threads); also what ``tools/probe_engine_alone.py`` serves its engine under."""
        from kvrt.accounting.budget import Budget, choose_budget
        from kvrt.accounting.estimate import load_vram_table
        from kvrt.accounting.ledger import VramLedger
        from kvrt.serve.registry import ModelRegistry

        sys.setswitchinterval(args.gil_switch_s)
        if args.argmax_threads is not None:
            from kvrt.engine.argmax import set_threads

            set_threads(args.argmax_threads)
        table = load_vram_table(args.vram_table) if args.vram_table else None
        devices = _device_ledgers(args)
        if devices is not None:
            budget = Budget("devices", None, args.admit_percent, f"--devices {args.devices}")
            ledger = devices.ledger(devices.indices[0])
        else:
            budget = choose_budget(args.capacity_bytes, args.admit_percent)
            ledger = VramLedger(budget.capacity_bytes, admit_percent=args.admit_percent,
                                reconcile_every_s=args.reconcile_s if budget.source == "nvml" else None)
        registry = ModelRegistry(ledger, n_gpu_layers=args.n_gpu_layers, table=table,
                                 measure=args.charge == "measured", devices=devices)
        return cls(budget, ledger, devices, registry)

    def close(self) -> None:
        """The registry's models, then the ledgers."""
        self.registry.close()
        (self.devices or self.ledger).close()


def _device_ledgers(args: argparse.Namespace) -> DeviceLedgers | None:
    """One ledger per ``--devices`` device (None without it); refused with --capacity-bytes, and for the socket
    front without --batch-slots (per-agent contexts swap against one ledger)."""
    if args.devices is None:
        if args.replicas > 1:
            raise KvrtError(f"--replicas {args.replicas} needs --devices: copies of a model go on other devices")
        return None
    if args.capacity_bytes is not None:
        raise KvrtError("--devices gives each device's size (INDEX:SIZE or COUNTxSIZE); drop --capacity-bytes")
    if args.socket and not args.batch_slots:
        raise KvrtError("--devices with --socket needs --batch-slots: per-agent contexts are swapped in and out "
                        "against one ledger, a model's batch context goes where the model is placed")
    from kvrt.accounting.devices import DeviceLedgers, parse_devices

    return DeviceLedgers.from_specs(parse_devices(args.devices), admit_percent=args.admit_percent,
                                    reconcile_every_s=args.reconcile_s)


def _start_socket(args: argparse.Namespace, registry: ModelRegistry, budget: Budget) -> Daemon:
    """The socket front: an agent service (per-agent contexts, or ``--batch-slots``) over ``registry`` and its
    ledger, listening on ``--socket``."""
    from kvrt.serve.batched import BatchConfig, BatchedScheduler
    from kvrt.serve.daemon import Daemon
    from kvrt.serve.scheduler import Scheduler

    ledger = registry.ledger
    scheduler: Scheduler | BatchedScheduler
    if args.batch_slots:
        scheduler = BatchedScheduler(ledger, registry, config=BatchConfig(
            n_ctx=args.batch_cells, n_seq_max=args.batch_slots, n_threads=args.threads,
            host_bytes=args.batch_host_mib << 20, kv_layout=args.kv_layout,
            pad_gaps=args.pad_gaps == "on", even_chunks=args.even_chunks == "on",
            decode_wait_s=args.decode_wait_s, hold_s=args.hold_s, backend_sampling=args.backend_sampling == "on",
            host_write_behind=args.host_write_behind == "on", warmup=args.warmup),
            state_dir=args.state_dir)
    else:
        scheduler = Scheduler(ledger, registry, n_threads=args.threads, state_dir=args.state_dir,
                              prefetch=args.prefetch)
    try:
        daemon = Daemon(args.socket, scheduler, budget=budget, max_connections=args.max_connections,
                        idle_timeout_s=args.idle_timeout_s or None)
    except BaseException:
        scheduler.close()
        raise
    daemon.start()
    return daemon


class _Signals:
    """Counts SIGTERM and SIGINT; the main thread polls the count.

    Polling because a process signal may be delivered to any thread, and then it does not
    wake a main thread blocked without a timeout; the handler only counts (taking a lock
    in a signal handler can deadlock against the code it interrupted).
    """

    def __init__(self) -> None:
        self.count = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    def wait_for_first(self) -> None:
        while not self.count:
            time.sleep(_SIGNAL_POLL_S)


class _Fronts:
    """The fronts this process serves (either or both), stopped together: HTTP first (its streams end), then the
    socket daemon (the running request finishes, queued ones are refused, agents saved)."""

    def __init__(self) -> None:
        self.daemon: Daemon | None = None
        self.http: HttpFront | None = None

    def stop(self, timeout_s: float) -> bool:
        """Stop both within ``timeout_s``; False when the daemon's running request did not finish in time."""
        deadline = time.monotonic() + timeout_s
        if self.http is not None:
            self.http.close()
        if self.daemon is not None:
            return self.daemon.stop(max(deadline - time.monotonic(), 0.0))
        return True

    def unsaved(self) -> dict[str, str]:
        """Agents whose state could not be saved, with the reason (the HTTP front's named ``http:AGENT``)."""
        store = self.daemon.scheduler.store if self.daemon is not None else None
        unsaved = dict(store.unsaved) if store is not None else {}
        if self.http is not None:
            unsaved |= {f"http:{agent}": reason for agent, reason in self.http.server.agents.unsaved.items()}
        return unsaved


def _stop_within(fronts: _Fronts, timeout_s: float, signals: _Signals) -> bool:
    """Stop ``fronts`` on a helper thread within ``timeout_s``, so the main thread keeps seeing signals: a second
    one exits at once (so does a stop that overruns the timeout)."""
    first = signals.count
    outcome: list[bool] = []
    stopper = threading.Thread(target=lambda: outcome.append(fronts.stop(timeout_s)), name="kvrt-serve-stop",
                               daemon=True)
    stopper.start()
    limit = time.monotonic() + timeout_s + _SIGNAL_POLL_S
    while stopper.is_alive():
        stopper.join(_SIGNAL_POLL_S)
        overrun = time.monotonic() > limit
        if stopper.is_alive() and (signals.count > first or overrun):
            log.warning("%s: exiting now, without waiting for the running requests",
                        f"the fronts did not stop within --shutdown-timeout-s {timeout_s} s" if overrun
                        else "second signal during shutdown")
            if fronts.daemon is not None:
                fronts.daemon.path.unlink(missing_ok=True)
            _exit_now(1)
    return bool(outcome and outcome[0])


def _exit_now(status: int) -> None:
    """End the process at once (no interpreter teardown), output flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
