"""What saving agents after every turn costs (issue 27): the state dir's writes, alone and on a turn's clock.

An agent service with ``--state-dir`` saves each agent as its turn completes, before the
result is handed out (:mod:`kvrt.state.agentstore`: files written whole, fsynced, renamed,
the directory fsynced). The per-agent scheduler writes the agent's KV file and manifest,
the batched one a manifest (the transcript) only. For each history length in
``--history``:

``save``
    one :meth:`~kvrt.state.agentstore.AgentStore.save` timed alone, ``--rounds`` times: the
    KV state of that many tokens (captured from a context that prefilled them) with its
    manifest, and a KV-less manifest of a transcript of that length (the batched case).
``turn``
    a turn (a short prompt, ``--gen-tokens`` generated greedily) of one agent holding that
    history, with and without a state dir, in both services, alternated for ``--rounds``
    rounds; the difference is what the save adds to a turn's latency.

The state dir is a fresh directory under ``--state-root`` (default: the system's temporary
directory): its file system decides the fsync cost.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrt.accounting.ledger import VramLedger
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.errors import KvrtError
from kvrt.modelfiles.demo_model import demo_model_path
from kvrt.serve.batched import BatchConfig, BatchedScheduler
from kvrt.serve.scheduler import Scheduler
from kvrt.state.agentstore import AgentRecord, AgentStore
from kvrt.state.snapshot import Snapshot
from kvrt_bench._log import log
from kvrt_bench._stats import check_samples, machine, summarize, write_csv, write_json

HELP = "the cost of saving every agent after every turn (state dir writes, alone and on a turn's clock)"
PROMPT = " and then the next part of the story goes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF (default: the demo model, Gemma 3 270M)")
    parser.add_argument("--history", type=int, nargs="+", default=[256, 1024, 3072],
                        help="tokens an agent holds when it is saved")
    parser.add_argument("--gen-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="samples of each figure (>= 3)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--state-root", default=None, help="where the state dirs are made (its file system counts)")


def history_tokens(model: Model, n: int) -> list[int]:
    """``n`` token ids of ordinary text (the demo document's words, repeated)."""
    words = model.tokenize("The agent reads the terms of use, lists each obligation and writes a summary. ")
    return (words * (n // len(words) + 1))[:n]


def time_saves(model: Model, tokens: list[int], rounds: int, root: Path, threads: int | None) -> dict[str, Any]:
    """Median and range of a KV save (file + manifest) and of a KV-less manifest save, for ``tokens``."""
    with Context(model, ContextParams(n_ctx=len(tokens) + 256, n_threads=threads)) as ctx:
        prefill(ctx, tokens)
        snapshot = Snapshot.capture(ctx, 0, tokens=tokens)
    store = AgentStore(tempfile.mkdtemp(prefix="save-", dir=root))
    record = AgentRecord("agent", str(model.path), model.fingerprint, len(tokens) + 256, len(tokens), 0,
                         tuple(tokens))
    transcript_only = AgentRecord("batched", str(model.path), model.fingerprint, len(tokens) + 256, 0, 0,
                                  tuple(tokens))
    kv_ms, manifest_ms = [], []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            store.save(record, snapshot)
            kv_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            store.save(transcript_only, None)
            manifest_ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        snapshot.release()
        store.close()
    return {"kv_bytes": snapshot.nbytes, "kv_save_ms": summarize(kv_ms).as_dict(),
            "manifest_save_ms": summarize(manifest_ms).as_dict()}


def turn_ms(service: Scheduler | BatchedScheduler, model: Path, tokens: list[int], gen: int, n_ctx: int) -> float:
    """Latency of a turn of one agent that first took ``tokens`` as its history (untimed)."""
    with service as sched:
        sched.register("agent", model, n_ctx)
        sched.decode("agent", tokens, 1)
        t0 = time.perf_counter()
        sched.decode("agent", PROMPT, gen)
        return (time.perf_counter() - t0) * 1e3


def service(kind: str, state: Path | None, n_ctx: int, threads: int | None) -> Scheduler | BatchedScheduler:
    """The agent service of ``kind`` (on ``state``, when given) for one agent of ``n_ctx`` cells."""
    if kind == "per-agent":
        return Scheduler(VramLedger(1 << 50), n_threads=threads, state_dir=state)
    return BatchedScheduler(VramLedger(1 << 50), state_dir=state,
                            config=BatchConfig(n_ctx=n_ctx, n_seq_max=2, n_threads=threads))


def run(args: argparse.Namespace) -> int:
    check_samples(args.rounds)
    if any(n < 1 for n in args.history) or args.gen_tokens < 1:
        raise KvrtError("--history lengths and --gen-tokens must be positive")
    out = Path(args.out) / "state-writes"
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.state_root or tempfile.gettempdir())
    path = Path(args.model) if args.model else demo_model_path()
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(["kvrt bench state-writes", *sys.argv[3:]]),
                               "model": path.name, "state_root": str(root), "points": []}
    rows = []
    with Model(path) as model:
        for n in args.history:
            tokens = history_tokens(model, n)
            n_ctx = n + 512
            log(f"state-writes: {n} tokens: saves")
            point: dict[str, Any] = {"history": n, **time_saves(model, tokens, args.rounds, root, args.threads)}
            for kind in ("per-agent", "batched"):
                log(f"state-writes: {n} tokens: {kind} turns")
                arms: dict[str, list[float]] = {"without": [], "with": []}
                for _ in range(args.rounds):
                    for arm in arms:
                        state = Path(tempfile.mkdtemp(prefix="turns-", dir=root)) if arm == "with" else None
                        arms[arm].append(turn_ms(service(kind, state, n_ctx, args.threads), path, tokens,
                                                 args.gen_tokens, n_ctx))
                point[kind] = {f"turn_ms_{arm}_state_dir": summarize(v).as_dict() for arm, v in arms.items()}
                point[kind]["added_ms"] = (point[kind]["turn_ms_with_state_dir"]["median"]
                                           - point[kind]["turn_ms_without_state_dir"]["median"])
                rows.append({"history": n, "service": kind, "kv_bytes": point["kv_bytes"],
                             "kv_save_ms": point["kv_save_ms"]["median"],
                             "manifest_save_ms": point["manifest_save_ms"]["median"],
                             **{k: v["median"] if isinstance(v, dict) else v for k, v in point[kind].items()}})
            results["points"].append(point)
    write_json(out / "state-writes.json", results)
    write_csv(out / "state-writes.csv", rows)
    for row in rows:
        print(row)
    return 0
