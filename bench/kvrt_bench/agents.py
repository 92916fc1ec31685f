"""Admission control and time-slicing (seed 003, issue 4): co-residence, swap round trip, 50 agents.

``coresidence``: three different models, each asking for a huge context (``--huge-fraction``
of the budget in KV bytes). Naive: load each and create its context independently, all
alive at once, as three ``llama-completion`` processes would; on a GPU the later ones
fail in ``cudaMalloc``. On a machine without a GPU nothing is allocated naively (it would
take host RAM from everyone), and the naive demand is reported from the estimates,
labelled as computed. kvrt: register all three agents with the same contexts through
the ledger, decode each in turn; the accounting per owner is printed after each step.

``swap``: one agent with a ``--swap-docs`` token document (default 4096 and 32768):
re-prefill time vs swap-out (capture into the pinned host pool) and swap-in (restore
into the kept context, what the scheduler's same-shape handover does, and into a fresh
context), with the next-token logits compared bit for bit after the round trip. Where
CuPy sees a GPU the plain pinned host-to-device copy of the same bytes is measured side
by side as the transfer floor.

``timeslice``: ``--agents`` agents spread over the three models, each sending
``--requests`` requests in a closed loop (next one when the previous answers), a
ledger budget that keeps only ``--live`` contexts alive, so agents are swapped;
``--rounds`` alternates baseline and time-sliced runs and reports the medians. Compared
with the same requests run back to back, agent after agent, in one context per model created
before the clock starts, nothing swapped. Reports aggregate tokens/s of both and p50/p95/p99 latency overall and per
agent.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from kvrt.accounting.estimate import DeviceMeter, ModelShape, context_estimate
from kvrt.accounting.ledger import LedgerDenied, NvmlProbe, VramLedger
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.errors import KvrtError
from kvrt.modelfiles.testmodels import Shape, ensure_model, write_model
from kvrt.serve.protocol import error_reply
from kvrt.serve.scheduler import Scheduler
from kvrt.state.hostpool import HostPool
from kvrt_bench import _swap
from kvrt_bench._bounds import DEFAULT_TOLERANCE, Bound, enforce
from kvrt_bench._log import log
from kvrt_bench._peer import LlamaPeer
from kvrt_bench._plotting import draw
from kvrt_bench._stats import check_samples, machine, write_json
from kvrt_bench._timeslice import timeslice

HELP = "seed 003: three models with huge contexts, KV swap round trip vs re-prefill, 50 agents time-sliced"
PARTS = ("coresidence", "swap", "timeslice")
SMALL = Shape(label="small bench shape", n_layer=8, n_embd=256, n_head=8, n_head_kv=4, n_ff=512, n_vocab=512,
              n_ctx_train=65536, dtype="f32")
WIDE_KV = Shape(label="wide-KV small shape", n_layer=32, n_embd=256, n_head=2, n_head_kv=2, n_ff=512, n_vocab=512,
                n_ctx_train=131072, dtype="f32")
"""Tiny weights, 7B-like KV bytes per token (32 KiB): a third model whose huge context is huge on an H200 too."""
MAX_HUGE_CTX = 1 << 21
"""Cap on a co-residence context: llama.cpp's attention mask grows with n_ctx x n_ubatch, so a tiny model asked
for 60% of an H200 in KV cells (tens of millions) would be refused for its compute buffer, not its KV."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--models", default="", help="three comma-separated GGUFs (default: generated tiny shapes)")
    parser.add_argument("--capacity-bytes", type=int, default=None,
                        help="ledger budget (default: 90%% of the GPU through NVML; required without a GPU)")
    parser.add_argument("--huge-fraction", type=float, default=0.5, help="coresidence: KV bytes per agent / budget")
    parser.add_argument("--swap-model", default=None, help="swap: GGUF (default: the first of --models)")
    parser.add_argument("--swap-docs", default="4096,32768")
    parser.add_argument("--swap-peers", default="ram,disk",
                        help="swap: llama-cpp-python prompt caches to run beside kvrt ('' for none)")
    parser.add_argument("--peer-disk-max-tokens", type=int, default=None,
                        help="swap: run the disk cache only for documents of at most this many tokens (it pickles "
                             "the whole state and its logits array to disk: seconds per trial at 32k tokens)")
    parser.add_argument("--flash-attn", choices=("on", "off", "auto"), default="off",
                        help="swap: flash attention in kvrt's and the peer's contexts alike")
    parser.add_argument("--bound-tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--requests", type=int, default=4, help="timeslice: requests per agent")
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--live", type=int, default=6, help="timeslice: contexts the budget keeps alive")
    parser.add_argument("--agent-ctx", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timeslice: alternating baseline/time-sliced rounds (>= 3)")
    parser.add_argument("--threads", type=int, default=None)


def _models(args: argparse.Namespace, out: Path) -> list[Path]:
    if args.models:
        paths = [Path(p) for p in args.models.split(",") if p]
        if len(paths) != 3:
            raise KvrtError(f"--models needs three GGUFs, got {len(paths)}")
        return paths
    cache = out / "models"
    small = cache / "kvrt-small-bench.gguf"
    if not small.exists():
        cache.mkdir(parents=True, exist_ok=True)
        write_model(small, SMALL)
    return [ensure_model(cache, "tiny", seed=0), ensure_model(cache, "tiny", seed=1), small]


def _ledger(args: argparse.Namespace) -> VramLedger:
    if args.capacity_bytes is None and not NvmlProbe.available():
        raise KvrtError("no GPU visible through NVML: give --capacity-bytes")
    return VramLedger(args.capacity_bytes)


# -- (a) co-residence ------------------------------------------------------------------------------
def coresidence(args: argparse.Namespace, paths: list[Path]) -> dict[str, Any]:
    ledger = _ledger(args)
    shapes = [ModelShape.read(p) for p in paths]
    contexts = [min(MAX_HUGE_CTX, max(256, int(args.huge_fraction * ledger.max_bytes / s.kv_bytes_per_token())
                                      // 256 * 256)) for s in shapes]
    demand = [s.weight_bytes(on_gpu=DeviceMeter.gpu_present()) + context_estimate(s, n).total_bytes
              for s, n in zip(shapes, contexts)]
    result: dict[str, Any] = {"max_bytes": ledger.max_bytes, "models": [p.name for p in paths], "n_ctx": contexts,
                              "estimated_bytes": demand, "naive_demand_bytes": sum(demand)}
    log(f"coresidence: budget {ledger.max_bytes / 2**30:.2f} GiB; n_ctx {contexts}; naive demand "
         f"{sum(demand) / 2**30:.2f} GiB")
    if DeviceMeter.gpu_present():
        result["naive"] = _naive(paths, contexts, args.threads)
    else:
        result["naive"] = {"measured": False, "reason": "no GPU: a naive huge allocation would only take host RAM; "
                           "demand computed from estimates", "fits": sum(demand) <= ledger.max_bytes}
    steps = []
    with Scheduler(ledger, n_threads=args.threads) as sched:
        for i, (path, n_ctx) in enumerate(zip(paths, contexts)):
            try:
                info = sched.register(f"agent{i}", path, n_ctx)
                steps.append({"step": f"REGISTER agent{i}", "ok": True, **asdict(info),
                              "owners": ledger.snapshot().by_owner})
            except LedgerDenied as exc:
                steps.append({"step": f"REGISTER agent{i}", "ok": False, "reply": error_reply(exc)})
            log(f"  {steps[-1]['step']}: {'OK' if steps[-1]['ok'] else steps[-1]['reply']}")
        too_big = min(MAX_HUGE_CTX, int(1.1 * ledger.max_bytes / shapes[0].kv_bytes_per_token()) // 256 * 256)
        try:
            sched.register("too-big", paths[0], too_big)
            steps.append({"step": "REGISTER too-big", "ok": True, "n_ctx": too_big})
            sched.unregister("too-big")
        except LedgerDenied as exc:  # the refusal lmxd would send, with its numbers; nothing else changes
            steps.append({"step": "REGISTER too-big", "ok": False, "n_ctx": too_big, "reply": error_reply(exc)})
        log(f"  REGISTER too-big n_ctx={too_big}: {steps[-1].get('reply', 'OK')}")
        for agent in [a.agent_id for a in sched.agents()] * 2:
            r = sched.decode(agent, "Hello, my name is", 8)
            steps.append({"step": f"DECODE {agent}", "evicted": list(r.evicted), "restored": r.restored,
                          "latency_ms": r.metrics.latency_ms, "owners": ledger.snapshot().by_owner})
            log(f"  DECODE {agent}: evicted={','.join(r.evicted) or 'none'} restored={r.restored} "
                 f"{r.metrics.latency_ms:.1f} ms; allocated {ledger.allocated_bytes / 2**30:.2f} GiB")
        result["kvrt_agents_admitted"] = len(sched.agents())
    result["kvrt"] = steps
    return result


def _naive(paths: list[Path], contexts: list[int], threads: int | None) -> dict[str, Any]:
    """Independent model + huge context per agent, all kept alive, until one fails."""
    held: list[Any] = []
    outcome = []
    try:
        for path, n_ctx in zip(paths, contexts):
            try:
                model = Model(path)
                held.append(model)
                held.append(Context(model, ContextParams(n_ctx=n_ctx, n_threads=threads)))
                outcome.append({"model": path.name, "n_ctx": n_ctx, "ok": True})
            except KvrtError as exc:
                outcome.append({"model": path.name, "n_ctx": n_ctx, "ok": False, "error": str(exc)[:300]})
            log(f"  naive {path.name} n_ctx={n_ctx}: {'OK' if outcome[-1]['ok'] else 'FAILED'}")
    finally:
        for obj in reversed(held):
            obj.close()
    return {"measured": True, "agents_ok": sum(o["ok"] for o in outcome), "steps": outcome}


# -- (b) swap round trip -------------------------------------------------------------------------
def swap(args: argparse.Namespace, paths: list[Path]) -> dict[str, Any]:
    """Every ``--swap-docs`` length: kvrt, re-prefill, the ideal transfer and the peer's caches (see _swap)."""
    path = Path(args.swap_model) if args.swap_model else paths[0]
    pool = HostPool()
    with Model(path) as model:
        rows = [swap_point(model, n_doc, args, pool) for n_doc in (int(x) for x in args.swap_docs.split(",") if x)]
    return {"rows": rows, "method": _swap.__doc__}


def swap_point(model: Model, n_doc: int, args: argparse.Namespace, pool: HostPool) -> dict[str, Any]:
    """One document length: ``--trials`` kvrt round trips and re-prefills, the ideal, then each peer cache."""
    params = ContextParams(n_ctx=n_doc + 256, n_threads=args.threads, flash_attn=args.flash_attn)
    doc = _swap.document(model, n_doc)
    probe = model.tokenize(" fox", add_special=False)[0]
    with Context(model, params) as ctx, Batch(1) as one:
        prefill(ctx, doc, logits_last=False)  # untimed: the context's first prefill
        reference = _swap.next_logits(ctx, one, probe, n_doc)
        trials = [_swap.kvrt_trial(model, ctx, one, params, doc, probe, reference, pool) for _ in range(args.trials)]
    ideal_ms, ideal_kind = _swap.ideal_transfer(trials[0].nbytes)
    row: dict[str, Any] = {"model": model.path.name, "doc_tokens": n_doc, "ideal_kind": ideal_kind,
                           "kvrt": _swap.summarize_kvrt(trials, ideal_ms), "peer": {}}
    k = row["kvrt"]
    log(f"swap {model.path.name} {n_doc} tok: state {k['state_bytes'] / 1e6:.1f} MB; re-prefill "
         f"{k['reprefill_ms']:.1f} ms, out {k['swap_out_ms']:.1f}, in (kept ctx) {k['swap_in_kept_ms']:.1f} "
         f"[{k['swap_in_kept_ms_min']:.1f}-{k['swap_in_kept_ms_max']:.1f}], in (fresh ctx) "
         f"{k['swap_in_fresh_ms']:.1f}, switch {k['switch_ttft_ms']:.1f} ms; ideal {ideal_ms:.1f} ms ({ideal_kind}, "
         f"{k['ideal_gbps']:.1f} GB/s): fraction {k['fraction_of_ideal']:.3f}; exact {k['exact_all_trials']}")
    kinds = [c for c in args.swap_peers.split(",")
             if c and (c != "disk" or args.peer_disk_max_tokens is None or n_doc <= args.peer_disk_max_tokens)]
    if kinds:
        with LlamaPeer(model.path, n_ctx=params.n_ctx, n_threads=args.threads, n_gpu_layers=-1,
                       flash_attn=args.flash_attn == "on") as peer, tempfile.TemporaryDirectory() as folder:
            peer.llm.eval(doc)  # untimed: the peer's agent prefills its document once
            for kind in kinds:
                runs = [_swap.peer_trial(peer.llm, kind, doc, probe, Path(folder) / f"{kind}{i}")
                        for i in range(args.trials)]
                row["peer"][kind] = _swap.summarize_peer(runs, ideal_ms, int(np.argmax(reference)), k)
                p = row["peer"][kind]
                log(f"  peer {kind}: out {p['swap_out_ms']:.1f} ms, in {p['swap_in_ms']:.1f} ms (kvrt "
                     f"{p['kvrt_swap_in_speedup']:.1f}x faster), switch {p['switch_ttft_ms']:.1f} ms (kvrt "
                     f"{p['kvrt_switch_ttft_speedup']:.1f}x); state {p['state_bytes'] / 1e6:.1f} MB; next token "
                     f"= kvrt's: {p['next_token_equals_kvrt']}")
    return row


# -- driver ------------------------------------------------------------------------------------------
def _plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "swap" in results:
        rows = results["swap"]["rows"]
        series = [("re-prefill", [r["kvrt"]["reprefill_ms"] for r in rows]),
                  ("kvrt swap-in (kept ctx)", [r["kvrt"]["swap_in_kept_ms"] for r in rows]),
                  ("ideal transfer", [r["kvrt"]["ideal_ms"] for r in rows])]
        kinds = dict.fromkeys(kind for r in rows for kind in r["peer"])  # a length may run fewer peer caches
        series += [(f"peer {kind} load_state", [r["peer"].get(kind, {}).get("swap_in_ms", float("nan")) for r in rows])
                   for kind in kinds]
        fig, ax = plt.subplots(figsize=(7, 3.8))
        x = np.arange(len(rows))
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series):
            ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
        ax.set_xticks(x, [f"{r['doc_tokens']} tok" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("ms (log, median)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "swap.png", dpi=120)
        plt.close(fig)
    if "timeslice" in results:
        lat = sorted(r["latency_ms"] for r in results["timeslice"]["requests"])
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(lat, np.linspace(0, 1, len(lat)))
        ax.set_xlabel("request latency, ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{results['timeslice']['agents']} agents time-sliced")
        fig.tight_layout()
        fig.savefig(out / "timeslice_latency_cdf.png", dpi=120)
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out) / "agents"
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise KvrtError(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    if "swap" in parts:
        check_samples(args.trials)
    if "timeslice" in parts:
        check_samples(args.rounds)
    paths = _models(args, out)
    results: dict[str, Any] = {"machine": machine() | {"gpu_present": DeviceMeter.gpu_present()}}
    for part in parts:
        results[part] = {"coresidence": coresidence, "swap": swap, "timeslice": timeslice}[part](args, paths)
        write_json(out / "agents.json", results)
    draw(_plot, results, out)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("requests", "per_agent_latency_ms", "kvrt")}
                      if isinstance(v, dict) else v for k, v in results.items()}, indent=1, default=str))
    return enforce(agent_bounds(results), args.bound_tolerance, out)


def agent_bounds(results: dict[str, Any]) -> list[Bound]:
    """Swap-in no faster than its ideal transfer; time-slicing no more throughput than the same work back to back
    (one warmed context per model, nothing swapped: the scheduler serves one request at a time)."""
    bounds = [b for row in results.get("swap", {}).get("rows", []) for b in _swap.swap_bounds(row)]
    if "timeslice" in results:
        bounds.append(Bound("timeslice: throughput time-sliced / back to back",
                            results["timeslice"]["throughput_ratio"], 1.0,
                            "the same requests served one at a time, plus switches"))
    return bounds
