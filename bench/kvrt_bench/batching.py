"""Continuous batching of agents (issue 14): N agents with multi-turn conversations, batched vs one at a time.

Workload: ``--agents`` agents on one model share a system preamble, each has its own role
line, and each runs ``--turns`` turns (a user message of a few dozen tokens, then
``--gen-tokens`` generated greedily), in a closed loop: an agent sends its next turn when
its previous one answered. Arms, alternated for ``--rounds`` rounds:

``batched``
    :class:`kvrt.serve.batched.BatchedScheduler`: every agent's turn in flight at once,
    one ``llama_decode`` per step for all of them.
``back_to_back``
    :class:`kvrt.serve.scheduler.Scheduler` (one context per agent, all created before the
    clock starts, nothing swapped), the same turns sent one at a time, agent after agent.

Figures per round: aggregate generated tokens/s (wall clock, prefill included), TTFT
p50/p99 (submission to first sampled token), lost or mixed-up tokens (each agent's
history must be exactly its own prompts and the replies it received, in order), and
the fraction of the batched ideal: the tokens/s of bare decode steps of one batch of
``--agents`` sequences, each holding an agent's mid-run history, in one context.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

from kvrt.accounting.ledger import VramLedger
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.errors import KvrtError
from kvrt.modelfiles.demo_model import demo_model_path
from kvrt.serve.batched import BatchConfig, BatchedScheduler
from kvrt.serve.registry import ModelRegistry
from kvrt.serve.results import DecodeResult, percentiles
from kvrt.serve.scheduler import Scheduler
from kvrt_bench._bounds import DEFAULT_TOLERANCE, Bound, enforce, ideal_bound
from kvrt_bench._stats import (
    check_samples,
    machine,
    ratios,
    summarize,
    write_csv,
    write_json,
)

HELP = "N agents' multi-turn conversations decoded in one batch per step vs served one at a time"
PREAMBLE = ("You are one of a team of assistants working on a shared research report about renewable energy "
            "storage. Keep answers short, factual and in plain English. ")
TOPICS = ("battery chemistry", "pumped hydro", "grid frequency", "hydrogen", "thermal storage", "flywheels",
          "recycling", "costs", "safety", "policy")
QUESTIONS = ("Give one key fact about {t}.", "What is the main open problem with {t}?",
             "Name one number that matters for {t}, and why.", "Summarise {t} in one sentence for a reader.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF (default: the demo model, Gemma 3 270M)")
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternating back-to-back / batched rounds (>= 3)")
    parser.add_argument("--slots", type=int, default=64, help="turns the batched engine runs at once")
    parser.add_argument("--n-batch", type=int, default=BatchConfig.n_batch, help="the batched engine's tokens per step")
    parser.add_argument("--ideal-steps", type=int, default=8, help="decode steps timed for the batched ideal")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--bound-tolerance", type=float, default=DEFAULT_TOLERANCE)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def conversations(n_agents: int, n_turns: int) -> list[list[str]]:
    """Each agent's turns: the shared preamble and its role before the first question."""
    out = []
    for i in range(n_agents):
        topic = TOPICS[i % len(TOPICS)]
        role = f"You are assistant {i}; your topic is {topic}. "
        turns = [QUESTIONS[(i + k) % len(QUESTIONS)].format(t=topic) for k in range(n_turns)]
        out.append([PREAMBLE + role + "\nUser: " + turns[0] + "\nAssistant:"]
                   + [f"\nUser: {q}\nAssistant:" for q in turns[1:]])
    return out


def _cells_per_agent(model: Model, convo: list[list[str]], gen: int) -> int:
    return max(sum(len(model.tokenize(t, add_special=j == 0)) + gen for j, t in enumerate(turns)) for turns in convo)


def _lost_or_mixed(model: Model, turns: list[str], replies: list[DecodeResult], transcript: list[int]) -> int:
    """Tokens by which the agent's history differs from its own prompts and received replies, in order."""
    expected: list[int] = []
    for j, (text, reply) in enumerate(zip(turns, replies)):
        expected += model.tokenize(text, add_special=j == 0) + reply.tokens
        if reply.finish_reason == "eog" and len(transcript) > len(expected):
            expected.append(transcript[len(expected)])  # the end-of-generation token it sampled
    same = next((k for k, (a, b) in enumerate(zip(expected, transcript)) if a != b), min(len(expected),
                                                                                       len(transcript)))
    return max(len(expected), len(transcript)) - same


def _closed_loop(sched: Scheduler | BatchedScheduler, convo: list[list[str]], gen: int,
                 one_at_a_time: bool) -> tuple[float, list[list[DecodeResult]]]:
    """Every agent's turns in order; all agents in flight at once unless ``one_at_a_time``. Wall seconds."""
    replies: list[list[DecodeResult]] = [[] for _ in convo]
    t0 = time.perf_counter()
    if one_at_a_time:
        for j in range(len(convo[0])):
            for i, turns in enumerate(convo):
                replies[i].append(sched.decode(f"agent{i}", turns[j], gen))
        return time.perf_counter() - t0, replies
    flight: dict[Future[DecodeResult], int] = {sched.submit(f"agent{i}", turns[0], gen): i
                                               for i, turns in enumerate(convo)}
    while flight:
        done, _ = wait(flight, return_when=FIRST_COMPLETED)
        for future in done:
            i = flight.pop(future)
            replies[i].append(future.result())
            if len(replies[i]) < len(convo[i]):
                flight[sched.submit(f"agent{i}", convo[i][len(replies[i])], gen)] = i
    return time.perf_counter() - t0, replies


def _arm(name: str, sched: Scheduler | BatchedScheduler, path: Path, model: Model, convo: list[list[str]],
         gen: int, n_ctx: int) -> dict[str, Any]:
    for i in range(len(convo)):
        sched.register(f"agent{i}", path, n_ctx)
        if isinstance(sched, Scheduler):
            sched.activate(f"agent{i}")  # its context created before the clock, as the batched arm's is
    seconds, replies = _closed_loop(sched, convo, gen, one_at_a_time=name == "back_to_back")
    generated = sum(len(r.tokens) for rows in replies for r in rows)
    ttft = percentiles([r.metrics.first_token_ms for rows in replies for r in rows])
    later = [r.metrics.first_token_ms for rows in replies for r in rows[1:]]
    steady = percentiles(later) if later else ttft  # turns after the first: every agent already in flight
    lost = sum(_lost_or_mixed(model, convo[i], replies[i], sched.transcript(f"agent{i}")) for i in range(len(convo)))
    row = {"arm": name, "seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
           "ttft_p50_ms": ttft.p50, "ttft_p99_ms": ttft.p99, "ttft_p99_over_p50": ttft.p99 / ttft.p50,
           "steady_ttft_p50_ms": steady.p50, "steady_ttft_p99_ms": steady.p99,
           "steady_ttft_p99_over_p50": steady.p99 / steady.p50,
           "lost_or_mixed_tokens": lost, "replies": [[r.tokens for r in rows] for rows in replies]}
    if isinstance(sched, BatchedScheduler):
        (stats,) = sched.engine_stats().values()
        row |= {"steps": stats.steps, "step_ms": stats.busy_s / max(stats.steps, 1) * 1e3,
                "decode_share_of_steps": stats.decode_s / stats.busy_s if stats.busy_s else 0.0,
                "steps_share_of_wall": stats.busy_s / seconds}
        _log(f"{name}: {stats.steps} steps of {row['step_ms']:.1f} ms ({row['decode_share_of_steps']:.0%} in "
             f"llama_decode), steps {row['steps_share_of_wall']:.0%} of the wall time")
    _log(f"{name}: {generated} tokens in {seconds:.2f} s = {row['tokens_per_s']:.1f} tok/s, TTFT p50 "
         f"{ttft.p50:.0f} ms p99 {ttft.p99:.0f} ms (turns after the first: p50 {steady.p50:.0f} p99 "
         f"{steady.p99:.0f}), lost/mixed {lost}")
    return row


def batched_ideal(model: Model, n_seq: int, held: int, steps: int, threads: int | None) -> dict[str, float]:
    """Tokens/s of bare decode steps of one batch of ``n_seq`` sequences holding ``held`` tokens each (its own
    cells each: the ideal pays the attention over every agent's history, not the scheduling)."""
    n_ctx = n_seq * (held + steps + 1)
    params = ContextParams(n_ctx=n_ctx, n_batch=max(512, n_seq), n_ubatch=512, n_seq_max=n_seq, kv_unified=True,
                           n_threads=threads)
    with Context(model, params) as ctx, Batch(max(512, n_seq)) as batch:
        doc = model.tokenize(PREAMBLE * (held // 8 + 1), add_special=True)[:held]
        for s in range(n_seq):  # cells of its own for every sequence, as every agent's history has
            prefill(ctx, doc[s % 7:] + doc[:s % 7], seq_id=s, batch=batch)
        times = []
        for step in range(steps + 1):
            batch.clear()
            for s in range(n_seq):
                batch.add(doc[(step + s) % held], held + step, s, logits=True)
            t0 = time.perf_counter()
            ctx.decode(batch)
            ctx.logits(n_seq - 1)  # waits for the step's compute
            times.append(time.perf_counter() - t0)
    step_s = summarize(times[1:]).median  # the first step warms up
    return {"n_seq": n_seq, "held_tokens": held, "step_ms": step_s * 1e3, "tokens_per_s": n_seq / step_s}


def run(args: argparse.Namespace) -> int:
    check_samples(args.rounds)
    if args.agents < 1 or args.turns < 1 or args.gen_tokens < 1:
        raise KvrtError("--agents, --turns and --gen-tokens must be positive")
    out = Path(args.out) / "batching"
    out.mkdir(parents=True, exist_ok=True)
    path = Path(args.model) if args.model else demo_model_path()
    convo = conversations(args.agents, args.turns)
    ledger = VramLedger(1 << 50)  # admission is not what this measures
    registry = ModelRegistry(ledger, n_gpu_layers=args.n_gpu_layers)
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(["kvrt bench batching", *sys.argv[3:]]),
                               "model": path.name, "config": {k: v for k, v in vars(args).items() if not callable(v)}}
    rows: list[dict[str, Any]] = []
    try:
        model = registry.acquire(path).model
        per_agent = _cells_per_agent(model, convo, args.gen_tokens)
        n_ctx = -(-per_agent // 256) * 256
        cells = args.agents * per_agent + args.slots * args.gen_tokens + 512
        _log(f"{args.agents} agents x {args.turns} turns x {args.gen_tokens} tokens on {path.name}: "
             f"{per_agent} cells each at most, {cells} shared cells batched")
        for k in range(args.rounds):
            for name in ("back_to_back", "batched"):
                if name == "batched":
                    config = BatchConfig(n_ctx=cells, n_seq_max=min(args.slots, args.agents), n_batch=args.n_batch,
                                         n_threads=args.threads)
                    sched: Scheduler | BatchedScheduler = BatchedScheduler(ledger, registry, config=config)
                else:
                    sched = Scheduler(ledger, registry, n_threads=args.threads)
                with sched:
                    rows.append(_arm(name, sched, path, model, convo, args.gen_tokens, n_ctx) | {"round": k})
        held = per_agent - args.gen_tokens // 2
        results["ideal"] = batched_ideal(model, args.agents, held, args.ideal_steps, args.threads)
    finally:
        registry.close()
    results |= summarise(rows, results["ideal"]["tokens_per_s"])
    results["rounds"] = [{k: v for k, v in r.items() if k != "replies"} for r in rows]
    results["greedy_agreement"] = _agreement(rows)
    write_csv(out / "batching.csv", results["rounds"])
    write_json(out / "batching.json", results)
    _log(f"batched / back to back: {results['speedup']['median']:.2f}x, fraction of the batched ideal "
         f"{results['fraction_of_ideal']['median']:.2f}; {out / 'batching.json'}")
    bounds = [ideal_bound("batched tokens/s / one batch of all agents' decode steps",
                          results["fraction_of_ideal"]["max"], "bare decode steps of one batch of every agent"),
              Bound("lost or mixed-up tokens", float(sum(r["lost_or_mixed_tokens"] for r in rows)), 0.0,
                    "every agent's history is its own prompts and replies")]
    return enforce(bounds, args.bound_tolerance, out)


def summarise(rows: list[dict[str, Any]], ideal_tps: float) -> dict[str, Any]:
    """Per-round ratios of the two arms (same round), and each arm's figures summarised."""
    arms = {name: [r for r in rows if r["arm"] == name] for name in ("back_to_back", "batched")}
    out: dict[str, Any] = {"speedup": ratios([r["tokens_per_s"] for r in arms["batched"]],
                                             [r["tokens_per_s"] for r in arms["back_to_back"]]).as_dict(),
                           "fraction_of_ideal": summarize(r["tokens_per_s"] / ideal_tps
                                                          for r in arms["batched"]).as_dict()}
    for name, arm in arms.items():
        out[name] = {key: summarize(r[key] for r in arm).as_dict()
                     for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "ttft_p99_over_p50",
                                 "steady_ttft_p50_ms", "steady_ttft_p99_ms", "steady_ttft_p99_over_p50")}
        out[name]["lost_or_mixed_tokens"] = sum(r["lost_or_mixed_tokens"] for r in arm)
    return out


def _agreement(rows: list[dict[str, Any]]) -> float:
    """Fraction of reply tokens the batched arm shares with the one-at-a-time arm (greedy; batched kernels
    round differently, so near ties may part; this is not a loss)."""
    first = {r["arm"]: r["replies"] for r in rows if r["round"] == 0}
    same = total = 0
    for a, b in zip(first["back_to_back"], first["batched"]):
        for x, y in zip(a, b):
            total += len(x)
            same += next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return same / total if total else 1.0
