"""Several real models under one KV memory cap, a real bursty trace: static reservation vs elastic contexts.

Measured, not simulated: real GGUFs (``--models``, or ``--n-models`` generated test
models with different weights), real llama.cpp contexts, real prefill and decode, a
real clock. One server thread takes the requests in arrival order (a request waits
while an earlier one runs), as one llama.cpp process serving several models would.
Both arms charge the same header-derived estimate (KV plus compute buffer) to one
:class:`kvrt.accounting.ledger.VramLedger` capped at ``--cap-mib``:

``static``
    stock llama.cpp's policy: a model serves from a context of its whole
    ``--max-ctx``, created when the model becomes resident (its KV allocated and
    cleared) and kept; a request to a model that is not resident evicts the least
    recently used resident models until the new context fits, then creates it.
``elastic``
    one :class:`kvrt.memory.elastic_context.ElasticContext` per model (256 cells at
    registration, before the clock); a request empties its sequence and grows the
    context to the bucket its prompt + ``max_tokens`` need; when the ledger refuses,
    the least recently used other agents shrink to their smallest bucket first.

The trace (``--seed``): per model, idle gaps (exponential, mean ``--gap-s``) and
bursts of 1-4 requests (exponential spacing, mean ``--burst-gap-s``) over
``--duration-s``; prompts of random token ids, log-uniform in [64, ``--max-prompt``]
tokens, 8-32 generated tokens, greedy. Both arms serve the same trace ``--repeats``
(>= 3) times, alternating. TTFT = first token - arrival (queueing, memory operations,
prefill); per repeat p50/p99, reported as median [min-max] over the repeats, with the
memory operations' time, contexts created, evictions and the peak of the ledger.
Greedy tokens of the two arms are compared request by request.

Idle co-residence, measured: how many ``--max-ctx`` contexts the cap admits when
created for real, against how many idle elastic agents (256-cell contexts, created for
real over the same models) it admits, up to ``--idle-probe``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.accounting.ledger import LedgerDenied, Reservation, VramLedger
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import Completion, GenerationParams, generate
from kvrt.engine.model import Model
from kvrt.memory.elastic_context import ElasticContext
from kvrt.modelfiles.testmodels import ensure_model
from kvrt_bench._plotting import draw
from kvrt_bench._stats import check_samples, machine, summarize, write_csv, write_json

HELP = "measured multi-model run: real models, a real bursty trace, static reservation vs elastic contexts"
MIN_CTX = 256
ARMS = ("static", "elastic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="", help="comma-separated GGUFs (default: --n-models test models)")
    parser.add_argument("--n-models", type=int, default=4, help="generated tiny test models (different weights)")
    parser.add_argument("--max-ctx", type=int, default=131072, help="each model's maximum context (cells)")
    parser.add_argument("--cap-mib", type=float, default=None,
                        help="KV memory cap of both arms (default: 2.5 static maxima: two models resident)")
    parser.add_argument("--duration-s", type=float, default=20.0, help="trace length (arrivals), real seconds")
    parser.add_argument("--gap-s", type=float, default=6.0, help="mean idle gap between a model's bursts")
    parser.add_argument("--burst-gap-s", type=float, default=0.3, help="mean spacing of a burst's requests")
    parser.add_argument("--max-prompt", type=int, default=1024, help="longest prompt (tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="replays of the trace per arm (>= 3)")
    parser.add_argument("--idle-probe", type=int, default=64, help="idle elastic agents to try to admit")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class Request:
    arrival_s: float
    model: int
    prompt: tuple[int, ...]
    max_tokens: int


def bursty_trace(vocab: Sequence[int], duration_s: float, gap_s: float, burst_gap_s: float, max_prompt: int,
                 seed: int) -> list[Request]:
    """Bursts of 1-4 requests per model after exponential idle gaps, sorted by arrival."""
    rng = np.random.default_rng(seed)
    requests = []
    for m, n_vocab in enumerate(vocab):
        t = float(rng.exponential(gap_s))
        while t < duration_s:
            for _ in range(int(rng.integers(1, 5))):
                length = int(np.exp(rng.uniform(np.log(64), np.log(max_prompt))))
                prompt = tuple(int(x) for x in rng.integers(3, min(n_vocab, 32000), length))
                requests.append(Request(t, m, prompt, int(rng.integers(8, 33))))
                t += float(rng.exponential(burst_gap_s))
            t += float(rng.exponential(gap_s))
    return sorted((r for r in requests if r.arrival_s < duration_s), key=lambda r: r.arrival_s)


@dataclass
class Served:
    """What serving one request took: its completion, when its first token came, the memory work before it."""

    completion: Completion
    first_token_at: float
    mem_ms: float
    contexts_created: int
    evictions: int


@dataclass
class StaticArm:
    """Resident models hold a context of their whole ``max_ctx``; the LRU idle ones are evicted to make room."""

    models: list[Model]
    max_ctx: int
    ledger: VramLedger
    threads: int | None
    resident: dict[int, tuple[Context, Reservation]] = field(default_factory=dict)
    last_used: dict[int, float] = field(default_factory=dict)

    def bytes_for(self, m: int) -> int:
        return context_estimate(ModelShape.read(self.models[m].path), self.max_ctx).total_bytes

    def _evict(self, m: int) -> None:
        ctx, charge = self.resident.pop(m)
        ctx.close()
        self.ledger.release(charge)

    def make_resident(self, m: int) -> tuple[int, int]:
        """(contexts created, evictions) to make model ``m`` resident."""
        if m in self.resident:
            return 0, 0
        need, evicted = self.bytes_for(m), 0
        while not self.ledger.fits(need):
            if not self.resident:
                raise LedgerDenied(owner=f"static:{m}", max_bytes=self.ledger.max_bytes,
                                   allocated_bytes=self.ledger.allocated_bytes, request_bytes=need)
            self._evict(min(self.resident, key=lambda r: self.last_used.get(r, 0.0)))
            evicted += 1
        charge = self.ledger.try_reserve(need, f"static:{m}")
        ctx = Context(self.models[m], ContextParams(n_ctx=self.max_ctx, n_threads=self.threads))
        self.resident[m] = (ctx, charge)
        return 1, evicted

    def serve(self, req: Request) -> Served:
        t0 = time.perf_counter()
        created, evicted = self.make_resident(req.model)
        ctx = self.resident[req.model][0]
        ctx.seq_rm(0)  # metadata only, as a server empties a slot (clear() would also zero the KV bytes)
        mem_ms = (time.perf_counter() - t0) * 1e3
        t_gen = time.perf_counter()
        done = generate(ctx, list(req.prompt), GenerationParams(max_tokens=req.max_tokens))
        self.last_used[req.model] = time.perf_counter()
        return Served(done, t_gen + done.timings_ms["first_token_ms"] / 1e3, mem_ms, created, evicted)

    def close(self) -> None:
        for m in list(self.resident):
            self._evict(m)


@dataclass
class ElasticArm:
    """One elastic context per model; under pressure the LRU other agents shrink to their smallest bucket."""

    agents: list[ElasticContext]
    last_used: dict[int, float] = field(default_factory=dict)

    @classmethod
    def register(cls, models: list[Model], max_ctx: int, ledger: VramLedger, threads: int | None) -> ElasticArm:
        return cls([ElasticContext(model, max_ctx=max_ctx, min_ctx=MIN_CTX, ledger=ledger, owner=f"elastic:{m}",
                                   params=ContextParams(n_threads=threads)) for m, model in enumerate(models)])

    def _shrink_one(self, keep: int) -> bool:
        """Shrink the least recently used other agent holding more than the smallest bucket; False if none."""
        big = [m for m, a in enumerate(self.agents) if m != keep and a.n_ctx > MIN_CTX]
        if not big:
            return False
        victim = self.agents[min(big, key=lambda m: self.last_used.get(m, 0.0))]
        victim.ctx.seq_rm(0)
        victim.shrink_to_fit()
        return True

    def serve(self, req: Request) -> Served:
        t0 = time.perf_counter()
        agent = self.agents[req.model]
        before = len(agent.resizes)
        agent.ctx.seq_rm(0)
        shrunk = 0
        while True:
            try:
                agent.ensure(len(req.prompt) + req.max_tokens)
                break
            except LedgerDenied:
                if not self._shrink_one(req.model):
                    raise
                shrunk += 1
        mem_ms = (time.perf_counter() - t0) * 1e3
        t_gen = time.perf_counter()
        done = agent.generate(list(req.prompt), GenerationParams(max_tokens=req.max_tokens))
        self.last_used[req.model] = time.perf_counter()
        return Served(done, t_gen + done.timings_ms["first_token_ms"] / 1e3, mem_ms, len(agent.resizes) - before,
                      shrunk)

    def close(self) -> None:
        for agent in self.agents:
            agent.close()


def replay(arm: StaticArm | ElasticArm, name: str, trace: list[Request], ledger: VramLedger,
           repeat: int) -> list[dict[str, Any]]:
    """Serve ``trace`` on a real clock, one request at a time in arrival order; one row per request."""
    rows = []
    peak = ledger.allocated_bytes
    t0 = time.perf_counter()
    for i, req in enumerate(trace):
        wait = req.arrival_s - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        start = time.perf_counter() - t0
        served = arm.serve(req)
        peak = max(peak, ledger.allocated_bytes)
        rows.append({"Arm": name, "Repeat": repeat, "Request": i, "Model": req.model, "Arrival_S": req.arrival_s,
                     "Prompt_Tokens": len(req.prompt), "Max_Tokens": req.max_tokens,
                     "Queue_Ms": (start - req.arrival_s) * 1e3,
                     "TTFT_Ms": (served.first_token_at - t0 - req.arrival_s) * 1e3, "Mem_Op_Ms": served.mem_ms,
                     "Contexts_Created": served.contexts_created, "Evictions": served.evictions,
                     "Ledger_Peak_Bytes": peak, "Tokens": " ".join(map(str, served.completion.tokens))})
    return rows


def idle_coresidence(models: list[Model], max_ctx: int, cap: int, probe: int, threads: int | None) -> dict[str, int]:
    """Real contexts: static maxima admitted by the cap, and idle elastic agents admitted, side by side."""
    ledger = VramLedger(cap)
    static = StaticArm(models, max_ctx, ledger, threads)
    admitted = 0
    try:
        for m in range(probe):
            if not ledger.fits(static.bytes_for(m % len(models))):
                break
            charge = ledger.try_reserve(static.bytes_for(m % len(models)), f"static:{m}")
            static.resident[m] = (Context(models[m % len(models)], ContextParams(n_ctx=max_ctx, n_threads=threads)),
                                  charge)
            admitted += 1
    finally:
        static.close()
    ledger = VramLedger(cap)
    agents: list[ElasticContext] = []
    try:
        for m in range(probe):
            try:
                agents.append(ElasticContext(models[m % len(models)], max_ctx=max_ctx, min_ctx=MIN_CTX, ledger=ledger,
                                             owner=f"idle:{m}", params=ContextParams(n_threads=threads)))
            except LedgerDenied:
                break
    finally:
        for agent in agents:
            agent.close()
    return {"static_models": admitted, "elastic_idle_agents": len(agents), "probe_limit": probe}


def _arm_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per repeat p50/p99 TTFT and totals; across repeats median [min-max]."""
    per_repeat = []
    for repeat in sorted({r["Repeat"] for r in rows}):
        mine = [r for r in rows if r["Repeat"] == repeat]
        ttft = [r["TTFT_Ms"] for r in mine]
        per_repeat.append({"repeat": repeat, "requests": len(mine), "ttft_p50_ms": float(np.percentile(ttft, 50)),
                           "ttft_p99_ms": float(np.percentile(ttft, 99)),
                           "mem_op_ms_total": sum(r["Mem_Op_Ms"] for r in mine),
                           "contexts_created": sum(r["Contexts_Created"] for r in mine),
                           "evictions": sum(r["Evictions"] for r in mine),
                           "ledger_peak_bytes": max(r["Ledger_Peak_Bytes"] for r in mine)})
    out: dict[str, Any] = {"per_repeat": per_repeat}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "mem_op_ms_total", "contexts_created", "ledger_peak_bytes"):
        out[key] = summarize(p[key] for p in per_repeat).as_dict()
    return out


def _models(args: argparse.Namespace, out: Path) -> list[Path]:
    if args.models:
        return [Path(p) for p in args.models.split(",") if p]
    return [ensure_model(out / "models", "tiny", seed=i) for i in range(args.n_models)]


def run(args: argparse.Namespace) -> int:
    check_samples(args.repeats)
    out = Path(args.out) / "multimodel"
    out.mkdir(parents=True, exist_ok=True)
    paths = _models(args, out)
    models = [Model(p, n_gpu_layers=args.n_gpu_layers) for p in paths]
    try:
        static_bytes = max(context_estimate(ModelShape.read(p), args.max_ctx).total_bytes for p in paths)
        cap = int(args.cap_mib * 2**20) if args.cap_mib else int(2.5 * static_bytes)
        trace = bursty_trace([m.n_vocab for m in models], args.duration_s, args.gap_s, args.burst_gap_s,
                             args.max_prompt, args.seed)
        print(f"multimodel: {len(models)} models, max_ctx {args.max_ctx} (static context {static_bytes / 2**20:.1f} "
              f"MiB each), cap {cap / 2**20:.1f} MiB, {len(trace)} requests over {args.duration_s:g} s, "
              f"{args.repeats} replays per arm", file=sys.stderr)
        rows: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            for name in (ARMS if repeat % 2 == 0 else ARMS[::-1]):
                ledger = VramLedger(cap)
                arm = (StaticArm(models, args.max_ctx, ledger, args.threads) if name == "static"
                       else ElasticArm.register(models, args.max_ctx, ledger, args.threads))
                try:
                    rows += replay(arm, name, trace, ledger, repeat + 1)
                finally:
                    arm.close()
                mine = [r["TTFT_Ms"] for r in rows if r["Arm"] == name and r["Repeat"] == repeat + 1]
                print(f"  replay {repeat + 1} {name}: TTFT p50 {np.percentile(mine, 50):.1f} ms, p99 "
                      f"{np.percentile(mine, 99):.1f} ms", file=sys.stderr)
        idle = idle_coresidence(models, args.max_ctx, cap, args.idle_probe, args.threads)
    finally:
        for model in models:
            model.close()
    result = _result(args, paths, cap, static_bytes, trace, rows, idle)
    write_csv(out / "requests.csv", rows)
    write_json(out / "multimodel.json", result)
    draw(_plot, rows, out / "ttft_cdf.png")
    _print(result)
    return 0


def _result(args: argparse.Namespace, paths: list[Path], cap: int, static_bytes: int, trace: list[Request],
            rows: list[dict[str, Any]], idle: dict[str, int]) -> dict[str, Any]:
    arms = {name: _arm_summary([r for r in rows if r["Arm"] == name]) for name in ARMS}
    by_key = {(r["Repeat"], r["Request"], r["Arm"]): r["Tokens"] for r in rows}
    pairs = [(by_key[(rep, i, "static")], by_key[(rep, i, "elastic")]) for rep, i, arm in by_key if arm == "static"]
    p99 = [s["ttft_p99_ms"] / e["ttft_p99_ms"] for s, e in zip(arms["static"]["per_repeat"],
                                                               arms["elastic"]["per_repeat"])]
    return {"measured": True, "machine": machine(), "method": __doc__,
            "args": {k: v for k, v in vars(args).items() if not callable(v)},
            "models": [p.name for p in paths], "cap_bytes": cap, "static_context_bytes": static_bytes,
            "requests": len(trace), "arms": arms, "p99_ttft_static_over_elastic": summarize(p99).as_dict(),
            "tokens_equal": sum(a == b for a, b in pairs), "tokens_compared": len(pairs), "idle_coresidence": idle}


def _print(result: dict[str, Any]) -> None:
    print("| arm | TTFT p50 ms | TTFT p99 ms | memory ops ms | contexts created | ledger peak MiB |")
    print("|---|---|---|---|---|---|")
    for name, a in result["arms"].items():
        cells = [f"{a[k]['median']:.1f} [{a[k]['min']:.1f}-{a[k]['max']:.1f}]"
                 for k in ("ttft_p50_ms", "ttft_p99_ms", "mem_op_ms_total")]
        print(f"| {name} | {' | '.join(cells)} | {a['contexts_created']['median']:.0f} | "
              f"{a['ledger_peak_bytes']['median'] / 2**20:.1f} |")
    r, idle = result["p99_ttft_static_over_elastic"], result["idle_coresidence"]
    print(f"p99 TTFT static / elastic {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]; same tokens in "
          f"{result['tokens_equal']}/{result['tokens_compared']} requests; idle co-resident under the cap: static "
          f"{idle['static_models']}, elastic {idle['elastic_idle_agents']} (of {idle['probe_limit']} tried)")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name in ARMS:
        ttft = sorted(r["TTFT_Ms"] for r in rows if r["Arm"] == name)
        ax.plot(ttft, np.linspace(0, 1, len(ttft)), label=f"{name} (all replays)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT ms (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("measured: real models, real bursty trace")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
