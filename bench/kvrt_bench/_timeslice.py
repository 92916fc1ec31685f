"""The time-slicing part of ``kvrt bench agents`` (see that harness's docstring): many agents over a few models
in a closed loop under a ledger budget that keeps only some contexts alive, against the same requests back to back.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvrt.accounting.estimate import DeviceMeter, ModelShape, context_estimate
from kvrt.accounting.ledger import VramLedger
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.model import Model
from kvrt.serve.results import percentiles
from kvrt.serve.scheduler import Scheduler
from kvrt_bench._log import log


def timeslice(args: argparse.Namespace, paths: list[Path]) -> dict[str, Any]:
    shapes = [ModelShape.read(p) for p in paths]
    on_gpu = DeviceMeter.gpu_present()
    if on_gpu:
        _warm_device(paths[-1], args.threads)
    weights = sum(s.weight_bytes(on_gpu=on_gpu) for s in shapes)
    per_ctx = max(context_estimate(s, args.agent_ctx).total_bytes for s in shapes)
    budget = weights + args.live * per_ctx
    if args.capacity_bytes is not None:
        budget = min(budget, args.capacity_bytes)
    assignment = [(f"agent{i:02d}", paths[i % len(paths)]) for i in range(args.agents)]
    prompts = [f" Turn {r}: the fox says" for r in range(args.requests)]
    log(f"timeslice: {args.agents} agents over {len(paths)} models, {args.requests} requests x {args.gen_tokens} "
         f"tokens each, budget {budget / 2**20:.1f} MiB ({args.live} live contexts)")

    ledger = VramLedger(budget)
    rounds: list[dict[str, float]] = []
    with Scheduler(ledger, n_threads=args.threads) as sched:
        for r in range(args.rounds):  # alternate, so load from other processes hits both sides alike
            # fresh agents each round: both sides start from empty documents of the same length
            agents = [(f"r{r}-{agent_id}", path) for agent_id, path in assignment]
            for agent_id, path in agents:
                sched.register(agent_id, path, args.agent_ctx)
            models = {e.path: e.model for e in sched.registry.models()}  # the baseline borrows them while idle
            base_wall, base_tokens = _back_to_back(models, agents, prompts, args)
            wall, tokens = _closed_loop(sched, agents, prompts, args.gen_tokens)
            ids = {agent_id for agent_id, _ in agents}
            latency = percentiles([m.latency_ms for m in sched.history() if m.agent_id in ids])
            for agent_id, _ in agents:
                sched.unregister(agent_id)
            rounds.append({"tokens_per_s": tokens / wall, "back_to_back_tokens_per_s": base_tokens / base_wall,
                           "wall_s": wall, "back_to_back_wall_s": base_wall, "tokens": tokens,
                           "latency_p50_ms": latency.p50, "latency_p99_ms": latency.p99,
                           "p99_over_p50": latency.p99 / latency.p50})
            rounds[-1]["throughput_ratio"] = rounds[-1]["tokens_per_s"] / rounds[-1]["back_to_back_tokens_per_s"]
            log(f"  round {len(rounds)}: time-sliced {rounds[-1]['tokens_per_s']:.1f} tok/s, back to back "
                 f"{rounds[-1]['back_to_back_tokens_per_s']:.1f} tok/s ({rounds[-1]['throughput_ratio']:.3f}); "
                 f"latency p50 {latency.p50:.1f} p99 {latency.p99:.1f} ms")
        history = sched.history()
        overall = sched.metrics()
    by_agent: dict[str, list[float]] = {}
    for m in history:
        by_agent.setdefault(m.agent_id, []).append(m.latency_ms)
    per_agent = {agent_id: asdict(percentiles(values)) for agent_id, values in by_agent.items()}
    sliced_tps = statistics.median(r["tokens_per_s"] for r in rounds)
    base_tps = statistics.median(r["back_to_back_tokens_per_s"] for r in rounds)
    lat = asdict(overall.latency_ms)
    result = {
        "agents": args.agents, "requests_per_agent": args.requests, "gen_tokens": args.gen_tokens,
        "live_contexts": args.live, "budget_bytes": budget, "rounds": rounds,
        "tokens_per_s": sliced_tps, "back_to_back_tokens_per_s": base_tps,
        "throughput_ratio": sliced_tps / base_tps, "latency_ms": lat, "p99_over_p50": lat["p99"] / lat["p50"],
        "queue_wait_ms": asdict(overall.queue_wait_ms), "swap_in_ms": asdict(overall.swap_in_ms),
        "swap_outs": overall.swap_outs, "swap_ins": overall.swap_ins,
        "swap_in_bytes": overall.swap_in_bytes,
        "context_creations": sum(1 for m in history if m.context_ms > 0), "per_agent_latency_ms": per_agent,
        "per_agent_p50_spread": max(v["p50"] for v in per_agent.values()) / min(v["p50"] for v in per_agent.values()),
        "requests": [vars(m) for m in history],
    }
    log(f"  median time-sliced {sliced_tps:.1f} tok/s vs back-to-back {base_tps:.1f} tok/s "
         f"({result['throughput_ratio']:.3f}); latency p50 {lat['p50']:.1f} p95 {lat['p95']:.1f} p99 {lat['p99']:.1f} "
         f"ms (p99/p50 {result['p99_over_p50']:.2f}); {overall.swap_ins} swap-ins")
    return result


def _closed_loop(sched: Scheduler, assignment: list[tuple[str, Path]], prompts: list[str],
                 gen_tokens: int) -> tuple[float, int]:
    """Every agent on its own thread sends its prompts one after another; returns (wall s, tokens)."""
    errors: list[BaseException] = []
    tokens = [0] * len(assignment)

    def client(i: int, agent_id: str) -> None:
        try:
            for prompt in prompts:
                tokens[i] += len(sched.decode(agent_id, prompt, gen_tokens).tokens)
        except BaseException as exc:  # noqa: BLE001 — re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i, a)) for i, (a, _) in enumerate(assignment)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, sum(tokens)


def _warm_device(path: Path, threads: int | None) -> None:
    """Create the process's CUDA context and library handles before anything is measured, so the
    first model's measured load is its weights and not the runtime's one-time overhead."""
    with Model(path) as model, Context(model, ContextParams(n_ctx=256, n_threads=threads)) as ctx:
        generate(ctx, "warm", GenerationParams(max_tokens=2))


def _back_to_back(models: dict[Path, Model], assignment: list[tuple[str, Path]], prompts: list[str],
                  args: argparse.Namespace) -> tuple[float, int]:
    """The same requests, agent after agent, nothing swapped: the best case without time-slicing.

    One context per model is created and warmed by one generation before the clock
    starts, and cleared between agents, so the baseline pays neither context creation
    nor any state copy.
    """
    params = ContextParams(n_ctx=args.agent_ctx, n_batch=min(512, args.agent_ctx),
                           n_ubatch=min(512, args.agent_ctx), n_threads=args.threads)
    contexts = {path: Context(model, params) for path, model in models.items()}
    try:
        for ctx in contexts.values():
            generate(ctx, prompts[0], GenerationParams(max_tokens=2))
        tokens = 0
        t0 = time.perf_counter()
        for _, path in assignment:
            ctx = contexts[path.resolve()]
            ctx.clear()
            for prompt in prompts:
                tokens += len(generate(ctx, prompt, GenerationParams(max_tokens=args.gen_tokens)).tokens)
        return time.perf_counter() - t0, tokens
    finally:
        for ctx in contexts.values():
            ctx.close()

