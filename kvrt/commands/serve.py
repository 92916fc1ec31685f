"""Run the kvrt daemon: one owner of the GPU for many agents, lmxd's protocol on a Unix socket.

Try it with ``nc -U PATH`` (send HELP). The ledger's cap is ``--admit-percent`` of the
GPU's memory as NVML reports it; on a machine without one, a stated share of host RAM
(:mod:`kvrt.budget`), unless ``--capacity-bytes`` fixes it.
SIGTERM or Ctrl-C shuts down cleanly (the running request finishes, queued ones get
``ERR SHUTTING_DOWN``, the socket file is removed).
"""

from __future__ import annotations

import argparse
import signal
import threading

HELP = "serve agents over a Unix socket (lmxd's protocol)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", required=True, help="Unix socket path (created 0600)")
    parser.add_argument("--capacity-bytes", type=int, default=None,
                        help="fixed ledger cap in bytes (default: the GPU's memory, or half the host RAM "
                             "where NVML sees no GPU)")
    parser.add_argument("--admit-percent", type=float, default=90.0, help="cap as a percent of GPU memory")
    parser.add_argument("--vram-table", default=None, help="lmxd model_vram table overriding derived estimates")
    parser.add_argument("--reconcile-s", type=float, default=5.0, help="re-read NVML every this many seconds")
    parser.add_argument("--n-gpu-layers", type=int, default=-1, help="layers to offload (-1: all)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per context")


def run(args: argparse.Namespace) -> int:
    from kvrt.budget import choose_budget
    from kvrt.daemon import Daemon
    from kvrt.estimate import load_vram_table
    from kvrt.ledger import VramLedger
    from kvrt.registry import ModelRegistry
    from kvrt.scheduler import Scheduler

    table = load_vram_table(args.vram_table) if args.vram_table else None
    budget = choose_budget(args.capacity_bytes, args.admit_percent)
    ledger = VramLedger(budget.capacity_bytes, admit_percent=args.admit_percent,
                        reconcile_every_s=args.reconcile_s if budget.source == "nvml" else None)
    scheduler = Scheduler(ledger, ModelRegistry(ledger, n_gpu_layers=args.n_gpu_layers, table=table),
                          n_threads=args.threads)
    try:
        daemon = Daemon(args.socket, scheduler, budget=budget)
    except BaseException:
        scheduler.close()
        raise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    daemon.start()
    print(f"kvrt serve: listening on {daemon.path} (ledger max {ledger.max_bytes} B from {budget.source}: "
          f"{budget.reason})", flush=True)
    try:
        stop.wait()
    finally:
        daemon.stop()
        scheduler.registry.close()
        ledger.close()
    return 0
