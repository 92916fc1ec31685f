#!/usr/bin/env python3
"""How fast does kvrt's engine run ``kvrt bench peer``'s workloads without the HTTP front? (issue 24)

The peer's kvrt arm is ``kvrt serve --http``: the engine's worker thread shares one interpreter (one GIL) with
the front's event loop, which parses every request and streams every token. This probe runs the same workloads
on the same engine in-process, with no front, so that a run of both on one machine tells what the front costs.

"The same engine": the peer's own functions give the sizes (``workload_sizes``), the cells, batch sizes, flash
attention and threads of its kvrt arm at ``--agents`` N (``server_config``) and that arm's ``kvrt serve`` argv
(``kvrt_arm``, with ``--kvrt-args``); kvrt's own command-line parser reads that argv and
:func:`kvrt.commands._http.engine_config` turns it into the engine's config, and the model is loaded as the server
loads it (a ledger, a registry and a :class:`kvrt.serve.model_pool.ModelPool`: the engine's warm-up and step trace
included). Each request is made by the HTTP front's own :func:`kvrt.serve.openai_schema.engine_request` from the
body the peer's client sends (greedy, ``ignore_eos``, no agent named: the peer names none, so neither does this).
As the peer restarts its server every round and runs the workloads one after another on it, each round here gets a
fresh engine (warmed with the peer's short request) and runs the workloads on it in turn.

A workload's N agents start together and run closed loop: an agent's next turn is submitted as soon as its
previous one ended, its prompt built by ``Workload.next_prompt`` from the ids it got. One driver thread does it
all: every stream's ``notify`` puts the agent's index into a queue, the driver drains that stream's events,
keeps the token ids and submits the next turn at its end. Per workload and round: the peer's own figures of a
workload (``turn_metrics``: wall seconds from the first submit to the last end, output tokens, lost tokens,
TTFT p50/p99 per turn, the driver's gap between an agent's turns) and the engine's counters diffed over it
(``kvrt_*``, as the peer's rows name them). ``--step-trace DIR``: each workload's engine steps in
``DIR/engine-n<N>-r<round>-<workload>.jsonl`` (``tools/step_trace_summary.py`` sums one up).

Usage: probe_engine_alone.py --model GGUF [--preset h200] [--agents 32] [--workloads private] [--rounds 1]
       [--step-trace DIR] [--kvrt-args "--hold-s 0.2"] [--peer-args "--gen-tokens 32"] [--out FILE.json]
"""

# ruff: noqa: I001  (kvrt first: it maps llama.cpp before NumPy is imported)
from __future__ import annotations

import argparse
import functools
import json
import queue
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import kvrt  # noqa: F401  (loads llama.cpp first: see DEVELOPING.md)
from kvrt.cli import build_parser
from kvrt.commands._http import engine_config
from kvrt.errors import KvrtError
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import Request, RequestEnd, RequestStream, TokenEvent
from kvrt.serve.openai_schema import CompletionBody, engine_request, parse
from kvrt.system.cpu import safe_extra_bufts
from kvrt_bench import peer
from kvrt_bench._peer_client import TurnResult, turn_metrics
from kvrt_bench._peer_servers import ServerArm, kvrt_arm
from kvrt_bench._peer_workloads import WORKLOADS, Workload, build, safe_vocabulary
from kvrt_bench._stats import machine

WARM_TOKENS, WARM_GEN = 16, 2  # the peer's warm-up request: the vocabulary's first 16 ids, 2 output tokens


@dataclass(frozen=True)
class Requests:
    """Makes the engine's :class:`Request` for a prompt exactly as the HTTP front makes it from the peer's body
    (``body``: parsed once; ``serve``: the ``kvrt serve`` options that take part, ``--max-tokens`` and
    ``--exact-prefix``)."""

    body: CompletionBody
    engine: Engine
    serve: argparse.Namespace

    def make(self, prompt: list[int]) -> Request:
        return engine_request(self.body, prompt, n_cells=self.engine.n_cells, n_vocab=self.engine.model.n_vocab,
                              max_tokens=self.body.max_tokens, default_max_tokens=self.serve.max_tokens,
                              logprobs=None, exact_prefix=self.serve.exact_prefix, agent=None)


def requests_for(arm: ServerArm, engine: Engine, serve: argparse.Namespace, gen: int) -> Requests:
    """The request maker of ``gen`` output tokens a turn: the body the peer's client sends ``arm``, parsed by the
    HTTP front's own schema (the prompt in it is a placeholder: each request gets its own)."""
    return Requests(parse(CompletionBody, arm.body([0], gen)), engine, serve)


def peer_args(args: argparse.Namespace, n: int) -> argparse.Namespace:
    """``kvrt bench peer``'s options as the peer would parse them for this probe's preset, N, workloads and
    ``--kvrt-args`` (``--peer-args``: more of its options, e.g. size overrides)."""
    parser = argparse.ArgumentParser(add_help=False)
    peer.add_arguments(parser)
    return parser.parse_args(["--preset", args.preset, "--agents", str(n), "--workloads", args.workloads,
                              "--kvrt-args", args.kvrt_args, *shlex.split(args.peer_args)])


def serve_args(arm: ServerArm) -> argparse.Namespace:
    """The peer's ``kvrt serve`` argv for its kvrt arm, parsed by kvrt's own command line."""
    return build_parser().parse_args(arm.argv[arm.argv.index("serve"):])


@contextmanager
def served_engine(serve: argparse.Namespace, model: Path, trace_dir: Path | None) -> Iterator[Engine]:
    """The engine ``kvrt serve --http`` would make of ``serve``'s options: under its process settings, ledger and
    registry (:meth:`kvrt.commands.serve.Accounts.of`), the model loaded through a :class:`ModelPool` (the front's
    ``start_front``), its steps traced to ``trace_dir/MODEL.jsonl``. Everything is freed on the way out."""
    from kvrt.commands.serve import Accounts
    from kvrt.serve.model_pool import ModelPool

    accounts = Accounts.of(serve)
    pool = None
    try:
        pool = ModelPool(accounts.registry, engine_config(serve), models={model.stem: model},
                         step_trace_dir=trace_dir)
        pool.preload(model.stem)
        yield pool.engines[model.stem]
    finally:
        if pool is not None:
            pool.close_engines()
            pool.close()
        accounts.close()


def _submit(engine: Engine, make: Callable[[list[int]], Request], agent: int, turn: int, prompt: list[int],
            gen: int, notify: Callable[[], None]) -> tuple[TurnResult, RequestStream | None]:
    """Submit one turn; a refusal is recorded in its result (no stream), as the peer's client records an error."""
    result = TurnResult(agent, turn, len(prompt), gen, time.perf_counter())
    try:
        return result, engine.submit(make(prompt), notify=notify)
    except KvrtError as exc:
        result.error, result.end_s = f"{type(exc).__name__}: {exc}", time.perf_counter()
        return result, None


def _take(stream: RequestStream, result: TurnResult) -> bool:
    """Drain ``stream``'s waiting events into ``result``; True once its :class:`RequestEnd` came."""
    while (event := stream.poll()) is not None:
        if isinstance(event, TokenEvent):
            if result.first_s is None:
                result.first_s = time.perf_counter()
            result.tokens.append(event.token)
        elif isinstance(event, RequestEnd):
            result.end_s, result.received = time.perf_counter(), len(result.tokens)
            result.reported, result.cached = event.completion_tokens, event.cached_tokens
            if event.error is not None:
                result.error = f"{type(event.error).__name__}: {event.error}"
            return True
    return False


def run_workload(engine: Engine, workload: Workload, make: Callable[[list[int]], Request],
                 timeout_s: float) -> tuple[float, list[TurnResult]]:
    """Every agent's turns, closed loop, from one driver thread (see the module docstring): the wall seconds from
    the first submit to the last end, and every turn (agent, then turn order). An agent whose turn failed or came
    back short stops there, as in the peer; no event for ``timeout_s`` cancels what runs."""
    n, turns, gen = workload.n_agents, workload.sizes.turns, workload.sizes.gen
    ready: queue.SimpleQueue[int] = queue.SimpleQueue()
    notify = [functools.partial(ready.put, i) for i in range(n)]
    results: list[list[TurnResult]] = [[] for _ in range(n)]
    streams: list[RequestStream | None] = [None] * n
    prompts = [list(p) for p in workload.first]
    for i in range(n):
        result, streams[i] = _submit(engine, make, i, 0, prompts[i], gen, notify[i])
        results[i].append(result)
    running = sum(s is not None for s in streams)
    while running:
        try:
            i = ready.get(timeout=timeout_s)
        except queue.Empty:
            _give_up(streams, results, timeout_s)
            break
        stream, result = streams[i], results[i][-1]
        if stream is None or not _take(stream, result):
            continue
        streams[i], running = None, running - 1
        if result.complete and result.turn + 1 < turns:
            prompts[i] = workload.next_prompt(i, result.turn + 1, prompts[i], result.tokens)
            result, streams[i] = _submit(engine, make, i, result.turn + 1, prompts[i], gen, notify[i])
            results[i].append(result)
            running += streams[i] is not None
    flat = [r for rows in results for r in rows]
    return max(r.end_s for r in flat) - min(r.sent_s for r in flat), flat


def _give_up(streams: list[RequestStream | None], results: list[list[TurnResult]], timeout_s: float) -> None:
    """Cancel every turn still running and mark it failed (no event came for ``timeout_s``)."""
    for i, stream in enumerate(streams):
        if stream is not None:
            stream.cancel()
            result = results[i][-1]
            result.error, result.end_s = f"no event within {timeout_s} s", time.perf_counter()
            result.received = len(result.tokens)


def settled_stats(engine: Engine) -> dict[str, Any]:
    """The engine's counters once the step that ended the last request is accounted for: a command runs on the
    worker at the start of its next step, after the last one's counters and trace line were written."""
    engine.cached_prefix((0,)).result()
    return asdict(engine.stats())


def warm(engine: Engine, make: Callable[[list[int]], Request], vocabulary: list[int], timeout_s: float) -> None:
    """The peer's warm-up request, before the first workload: the same prompt, the same output tokens."""
    result = engine.submit(make(vocabulary[:WARM_TOKENS])).result(timeout_s)
    if len(result.choices[0].tokens) != WARM_GEN:
        raise KvrtError(f"the warm-up request returned {len(result.choices[0].tokens)} of {WARM_GEN} tokens")


def measure(engine: Engine, workload: Workload, make: Callable[[list[int]], Request], timeout_s: float,
            trace: tuple[Path, Path] | None) -> dict[str, Any]:
    """``workload``'s row: the peer's figures of its turns and the engine's counters diffed over it; ``trace``:
    (the engine's step trace file, where this workload's steps go)."""
    before = settled_stats(engine)
    start = trace[0].stat().st_size if trace is not None and trace[0].exists() else 0
    wall, results = run_workload(engine, workload, make, timeout_s)
    after = settled_stats(engine)
    if trace is not None and trace[0].exists():
        peer.copy_steps(trace[0], start, after["steps"] - before["steps"], trace[1])
    s = workload.sizes
    row: dict[str, Any] = turn_metrics(results, workload.n_agents, s.turns, s.gen, wall)
    row |= {f"kvrt_{k}": after[k] - before[k] for k in peer.KVRT_COUNTERS}
    return row | {"kvrt_kv_layout": after["kv_layout"], "kvrt_hold_s": after["hold_s"]}


def run_round(args: argparse.Namespace, k: int, model: Path, arm: ServerArm, serve: argparse.Namespace,
              workloads: dict[str, Workload], vocabulary: list[int]) -> list[dict[str, Any]]:
    """Round ``k``: a fresh engine, the peer's warm-up, then every workload on it in turn; their rows."""
    trace_dir = Path(args.step_trace) if args.step_trace else None
    rows = []
    with served_engine(serve, model, trace_dir / "server" if trace_dir else None) as engine:
        warm(engine, requests_for(arm, engine, serve, WARM_GEN).make, vocabulary, args.request_timeout_s)
        for name, workload in workloads.items():
            trace = ((trace_dir / "server" / f"{model.stem}.jsonl",
                      trace_dir / f"engine-n{workload.n_agents}-r{k}-{name}.jsonl") if trace_dir else None)
            make = requests_for(arm, engine, serve, workload.sizes.gen).make
            row = measure(engine, workload, make, args.request_timeout_s, trace)
            rows.append({"n": workload.n_agents, "round": k, "arm": "engine-alone", "workload": name} | row)
            print_row(rows[-1], workload.sizes.turns)
    return rows


def print_row(row: dict[str, Any], turns: int) -> None:
    """One workload's line of the table, and the peer's per-step line of the engine's phases."""
    ttft = " ".join(f"t{t + 1} {row[f'ttft_p50_ms_turn{t + 1}']:.0f}/{row[f'ttft_p99_ms_turn{t + 1}']:.0f}"
                    for t in range(turns))
    print(f"  r{row['round']} {row['workload']:>8}: {row['wall_s']:7.2f} s, {row['output_tokens_per_s']:7.1f} tok/s,"
          f" {row['output_tokens']} tokens, lost {row['lost_tokens']}, TTFT p50/p99 ms {ttft}, "
          f"gap {row['client_gap_p50_ms']:.2f}/{row['client_gap_p99_ms']:.2f} ms, prefilled "
          f"{row['kvrt_prefilled_tokens']} reused {row['kvrt_reused_tokens']} restored "
          f"{row['kvrt_restored_tokens']}", flush=True)
    if row["kvrt_steps"]:
        print(f"  {'':>11}  {peer.step_times(row)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="GGUF")
    parser.add_argument("--preset", choices=sorted(peer.PRESETS), default="h200", help="the peer's sizes")
    parser.add_argument("--agents", type=int, default=32, help="N: agents, and the engine's slots")
    parser.add_argument("--workloads", default="private", help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=1, help="rounds, each on a fresh engine")
    parser.add_argument("--step-trace", metavar="DIR", default=None,
                        help="each workload's engine steps in DIR/engine-n<N>-r<round>-<workload>.jsonl")
    parser.add_argument("--kvrt-args", default="", help="more kvrt serve options (one string), as the peer's")
    parser.add_argument("--peer-args", default="", help="more kvrt bench peer options (one string), e.g. sizes")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts' tokens (the peer's --seed)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="longest wait for any event")
    parser.add_argument("--out", type=Path, default=None, help="JSON of every row and the settings")
    args = parser.parse_args()
    if args.rounds < 1 or args.agents < 1:
        raise SystemExit("--rounds and --agents must be positive")
    p = peer_args(args, args.agents)
    sizes = peer.workload_sizes(p)
    config = peer.server_config(p, args.agents, sizes, args.model, safe_extra_bufts().use_extra_bufts)
    arm = kvrt_arm(replace(config, extra=shlex.split(p.kvrt_args)))
    serve = serve_args(arm)
    vocabulary = safe_vocabulary(args.model)
    workloads = {name: build(name, s, args.agents, vocabulary, args.seed) for name, s in sizes.items()}
    print(f"N={args.agents}: {config.cells} cells, n_batch {config.n_batch}, prefill chunk {config.prefill_chunk}, "
          f"flash attention {config.flash_attn}, threads {config.threads}, {args.model.name}; "
          f"kvrt serve {shlex.join(arm.argv[arm.argv.index('serve') + 1:])}", flush=True)
    rows = [row for k in range(args.rounds) for row in run_round(args, k, args.model, arm, serve, workloads,
                                                                  vocabulary)]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "machine": machine(), "model": args.model.name, "probe": vars(args),
            "kvrt_serve_argv": arm.argv[arm.argv.index("serve"):], "engine_config": asdict(engine_config(serve)),
            "sizes": {name: asdict(s) for name, s in sizes.items()}, "rounds": rows}, indent=1, default=str) + "\n")
    lost = sum(r["lost_tokens"] for r in rows)
    print(f"{args.out or '(no --out)'}; lost output tokens: {lost}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
