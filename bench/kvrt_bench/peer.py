"""kvrt's OpenAI server against llama.cpp's own llama-server, side by side (issue 24): same GGUF, same libllama,
same KV cells, same agents.

Per ``--agents`` N, each arm is started as a subprocess (``kvrt serve --http`` with
``--slots N``; ``llama-server -np N``, and with ``--kv-unified`` a third arm with one KV
stream for all slots), health-checked and warmed with one short request, then runs the
workloads of :mod:`kvrt_bench._peer_workloads` one after another (fanout, swarm,
private: N agents at once, greedy, streamed, token-id prompts, ``max_tokens`` output
tokens a turn with end-of-generation ignored), and is killed. Arms alternate between
``--rounds``. A later turn's prompt is the previous prompt, the previous completion's ids
as that server streamed them, and new tokens. llama-server's stream leaves out the id of
a token whose text ends inside a UTF-8 character; for such a turn the ids are
llama-server's ``/tokenize`` of the completion's text (not always the ids it generated),
and the turn is counted in ``retokenized_requests``.

Per workload and arm: wall time, output tokens/s, TTFT p50/p99 per turn, the client's own
time between an agent's turns (``client_gap``; requests.csv has each request's send and end),
output tokens lost (every request must return all of them), prompt tokens the server reported as
cached, and kvrt's engine counters diffed over the workload (``/v1/kvrt/stats``:
prefilled, reused, restored tokens). The ideal: ``llama-batched-bench`` of the same build,
``-npp`` the first turn's prompt, ``-ntg`` every turn's output, ``-npl N`` (``-pps`` where
the document is shared, then the faster of llama.cpp's split and unified KV layouts): later
turns' appended tokens are not in it, so it is a bound.
Ratios: kvrt / llama-server wall time and tokens/s (same round), the ideal's time /
kvrt's. llama-server runs only where every slot's share of the cells (``cells / N``)
holds an agent's whole history; elsewhere its row says why it was skipped, and with ``--roomy``
an arm ``llama-server-roomy`` runs those workloads with the cells its slots need (``N`` x the
longest history; their ideal gets as many) and its host prompt cache off.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvrt.errors import KvrtError
from kvrt.modelfiles.demo_model import demo_model_path
from kvrt.system.cpu import safe_extra_bufts
from kvrt_bench._log import log
from kvrt_bench._peer_client import TurnResult, run_workload, stream_turn, token_agreement, turn_metrics
from kvrt_bench._peer_servers import (
    PeerError,
    ServerArm,
    ServerConfig,
    batched_bench,
    find_batched_bench,
    find_llama_server,
    kvrt_arm,
    llama_lib_dir,
    llama_server_arm,
)
from kvrt_bench._peer_workloads import WORKLOADS, Sizes, Workload, build, safe_vocabulary
from kvrt_bench._plotting import draw
from kvrt_bench._stats import machine, ratios, summarize, write_csv, write_json

HELP = "kvrt's OpenAI server vs llama.cpp's llama-server (same GGUF, libllama, cells): fanout, swarm, private"
ARMS = ("kvrt", "llama-server")
ROOMY = "llama-server-roomy"  # llama-server with the cells its slots need, for what --cells cannot hold (--roomy)
# The roomy arm keeps every agent's history in its own slot, so llama-server's host prompt cache (--cache-ram) can
# only add work there: each time a later workload takes a slot over, it copies the slot's whole state to host RAM
# and, once full, drops the oldest copy (bench/RESULTS.md, "H100, 2026-12-07 (second session)"). Off, as the arm
# best configured for what it runs; a --cache-ram in --server-args comes later and wins.
ROOMY_SERVER_ARGS = ("--cache-ram", "0")
# sizes per preset: (shared, own, turns, append) per workload, output tokens a turn, cells, n_batch, flash attention
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"fanout": (992, 32, 1, 0), "swarm": (512, 64, 4, 128), "private": (0, 768, 2, 64), "gen": 16,
            "agents": "8", "cells": 0, "n_batch": 512, "prefill_chunk": 256, "flash_attn": "off"},
    "h200": {"fanout": (8192, 32, 1, 0), "swarm": (4096, 64, 4, 128), "private": (0, 4096, 2, 64), "gen": 64,
             "agents": "8,32,64", "cells": 163840, "n_batch": 2048, "prefill_chunk": 512, "flash_attn": "on"},
}
SIZE_OPTIONS = {"fanout": ("fanout_doc", "fanout_question", None, None),
                "swarm": ("swarm_doc", "swarm_task", "swarm_turns", "swarm_append"),
                "private": (None, "private_history", "private_turns", "private_append")}
KVRT_COUNTERS = ("prefilled_tokens", "reused_tokens", "restored_tokens", "decoded_tokens", "steps", "busy_s",
                 "decode_s", "admit_s", "fill_s", "sample_s", "host_cpu_s", "relayouts", "relayout_s", "host_kept",
                 "host_keep_s", "micro_batches", "sampled_on_device", "sampler_switches")
CELL_ROUND = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF (default: the demo model, Gemma 3 270M)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="sizes: cpu (8 agents, ~1k-token prompts, 16 tokens a turn) or h200 (issue 24's: "
                             "8k/4k documents, 64 tokens a turn, 163,840 cells, N = 8,32,64); options below override")
    parser.add_argument("--agents", default=None, help="comma-separated N (agents = slots of both servers)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    for name, options in SIZE_OPTIONS.items():
        for option in options:
            if option:
                parser.add_argument("--" + option.replace("_", "-"), type=int, default=None,
                                    help=f"tokens ({name}; default from --preset)" if "turns" not in option
                                    else f"turns ({name}; default from --preset)")
    parser.add_argument("--gen-tokens", type=int, default=None, help="output tokens a turn (every workload)")
    parser.add_argument("--cells", type=int, default=None,
                        help="KV cells of both servers (0: N x the longest agent history, rounded up to 256)")
    parser.add_argument("--n-batch", type=int, default=None, help="tokens per llama_decode (-b; kvrt --n-batch)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="kvrt --prefill-chunk")
    parser.add_argument("--flash-attn", choices=("on", "off"), default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads of both servers")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, the arms' order alternating")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts' tokens")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    parser.add_argument("--kv-unified", action="store_true", help="also an arm llama-server --kv-unified")
    parser.add_argument("--roomy", action="store_true",
                        help="also an arm llama-server-roomy: llama-server given the cells its slots need (N x the "
                             "longest agent history), run only for the workloads it cannot hold in --cells (issue "
                             "24's fanout goal is against llama-server given the cells it needs), with its host prompt "
                             "cache off (--cache-ram 0: every agent keeps its own slot); the ideal of those "
                             "workloads gets as many cells")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (else $KVRT_LLAMA_SERVER, PATH)")
    parser.add_argument("--batched-bench", default=None,
                        help="llama-batched-bench binary (else $KVRT_BATCHED_BENCH, beside llama-server, PATH)")
    parser.add_argument("--kvrt-args", default="", help="more arguments for kvrt serve (one string)")
    parser.add_argument("--step-trace", action="store_true",
                        help="kvrt serve --step-trace: each workload's engine steps in OUT/steps/n<N>-r<round>-"
                             "<workload>.jsonl (tools/step_trace_summary.py sums one up)")
    parser.add_argument("--server-args", default="", help="more arguments for llama-server (one string)")
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--bench-timeout-s", type=float, default=600.0, help="llama-batched-bench's limit a point")


def workload_sizes(args: argparse.Namespace) -> dict[str, Sizes]:
    """Each selected workload's sizes: the preset's, overridden by the options given."""
    preset = PRESETS[args.preset]
    gen = args.gen_tokens or preset["gen"]
    names = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        raise KvrtError(f"--workloads {args.workloads!r}: pick from {', '.join(WORKLOADS)}")
    out = {}
    for name in names:
        values = [v if option is None or getattr(args, option) is None else getattr(args, option)
                  for v, option in zip(preset[name], SIZE_OPTIONS[name])]
        shared, own, turns, append = values
        out[name] = Sizes(shared, own, turns, append, gen)
    return out


def auto_cells(n: int, sizes: dict[str, Sizes]) -> int:
    """N agents' longest history each, rounded up to :data:`CELL_ROUND`: every slot of a llama-server without
    unified KV gets cells / N, so this is the least it needs."""
    longest = max(s.cells_per_agent for s in sizes.values())
    return n * -(-longest // CELL_ROUND) * CELL_ROUND


def server_config(args: argparse.Namespace, n: int, sizes: dict[str, Sizes], model: Path,
                  extra_bufts: bool) -> ServerConfig:
    """What every arm gets at ``n`` agents: ``--preset``'s cells (0: :func:`auto_cells`), batch sizes and flash
    attention, each overridden by its option when given, ``--threads``, and the machine's extra-buffer verdict
    (``extra_bufts``); also what ``tools/probe_engine_alone.py`` gives the engine it runs without the front."""
    preset = PRESETS[args.preset]
    cells = (preset["cells"] if args.cells is None else args.cells) or auto_cells(n, sizes)
    return ServerConfig(model, cells, n, args.n_batch or preset["n_batch"],
                        args.prefill_chunk or preset["prefill_chunk"], args.flash_attn or preset["flash_attn"],
                        args.threads, extra_bufts)


def _warm(arm: ServerArm, vocabulary: list[int], timeout_s: float) -> None:
    result = stream_turn(arm, -1, 0, vocabulary[:16], 2, timeout_s)
    if not result.complete:
        raise PeerError(f"{arm.name}'s warm-up request failed: {result.error or f'{len(result.tokens)} of 2 tokens'}")


def _skip_reason(arm: str, config: ServerConfig, sizes: Sizes) -> str | None:
    """Why ``arm`` does not run this workload in ``config``'s cells: llama-server without unified KV cannot hold
    it (cells / N a slot); the roomy arm runs exactly those."""
    short = config.cells // config.slots < sizes.cells_per_agent
    if arm == "llama-server" and short:
        return (f"llama-server gives each of {config.slots} slots {config.cells // config.slots} cells; an agent's "
                f"history needs {sizes.cells_per_agent}")
    if arm == ROOMY and not short:
        return "llama-server holds it in the shared cell count (its own row)"
    return None


def _measure(arm: ServerArm, workload: Workload, timeout_s: float,
             trace: tuple[Path, Path] | None = None) -> tuple[dict[str, Any], list[TurnResult]]:
    """Run ``workload`` on ``arm``: its row of figures and every turn. ``trace``: (the kvrt server's step trace
    file, where this workload's steps go): the lines the workload added are copied out."""
    before = arm.kvrt_stats()
    start = trace[0].stat().st_size if trace is not None and trace[0].exists() else 0
    wall, results = run_workload(arm, workload, timeout_s)
    after = arm.kvrt_stats()
    if trace is not None and trace[0].exists():
        copy_steps(trace[0], start, after.get("steps", 0) - before.get("steps", 0), trace[1])
    s = workload.sizes
    row = turn_metrics(results, workload.n_agents, s.turns, s.gen, wall)
    row |= {f"kvrt_{k}": after[k] - before[k] for k in KVRT_COUNTERS if k in after}
    for state in ("kv_layout", "hold_s"):  # what the engine ended the workload with
        if state in after:
            row[f"kvrt_{state}"] = after[state]
    ttft = " ".join(f"t{t + 1} {row[f'ttft_p50_ms_turn{t + 1}']:.0f}/{row[f'ttft_p99_ms_turn{t + 1}']:.0f}"
                    for t in range(s.turns))
    log(f"  {arm.name:>20} {workload.name:>8}: {wall:7.2f} s, {row['output_tokens_per_s']:7.1f} tok/s, "
        f"TTFT p50/p99 ms {ttft}"
        + (f", client gap {row['client_gap_p50_ms']:.1f}/{row['client_gap_p99_ms']:.1f}" if s.turns > 1 else "")
        + f", lost {row['lost_tokens']}, retokenized {row['retokenized_requests']}"
        + (f", kvrt prefilled {row['kvrt_prefilled_tokens']} reused {row['kvrt_reused_tokens']}"
           if "kvrt_prefilled_tokens" in row else ""))
    if row.get("kvrt_steps"):
        log(f"  {'':>20} {'':>8}  {step_times(row)}")
    return row, results


def copy_steps(server_trace: Path, start: int, steps: int, to: Path, wait_s: float = 5.0) -> None:
    """Copy the ``steps`` lines the server's trace has past byte ``start`` to ``to``. A step's line is written just
    after its tokens went out, so the last one may land a moment after the workload's last answer: wait for it."""
    deadline = time.monotonic() + wait_s
    while True:
        with server_trace.open("rb") as whole:
            whole.seek(start)
            data = whole.read()
        if data.count(b"\n") >= steps or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    to.parent.mkdir(parents=True, exist_ok=True)
    to.write_bytes(b"".join(data.splitlines(keepends=True)[:steps]))


def step_times(row: dict[str, Any]) -> str:
    """kvrt's steps, phase by phase, in ms a step (EngineStats), and the layout it ended in."""
    per_step = {k: row[f"kvrt_{k}"] / row["kvrt_steps"] * 1e3 for k in ("busy_s", "decode_s", "admit_s", "fill_s",
                                                                       "sample_s", "host_cpu_s")}
    return (f"kvrt {row['kvrt_steps']} steps of {per_step['busy_s']:.1f} ms: decode {per_step['decode_s']:.1f}, "
            f"admit {per_step['admit_s']:.2f}, fill {per_step['fill_s']:.2f}, sample {per_step['sample_s']:.2f} "
            f"(worker CPU {per_step['host_cpu_s']:.2f}), "
            f"{row.get('kvrt_micro_batches', 0) / row['kvrt_steps']:.2f} llama.cpp micro-batches; "
            f"layout {row.get('kvrt_kv_layout')}, hold {row.get('kvrt_hold_s', 0.0) * 1e3:.0f} ms, "
            f"{row.get('kvrt_relayouts', 0)} relayouts in {row.get('kvrt_relayout_s', 0.0):.2f} s; "
            f"{row.get('kvrt_host_kept', 0)} evicted slots copied to the "
            f"host tier in {row.get('kvrt_host_keep_s', 0.0):.2f} s, {row.get('kvrt_restored_tokens', 0)} tokens "
            f"restored; {row.get('kvrt_sampled_on_device', 0)} tokens sampled in the decode's graph "
            f"({row.get('kvrt_sampler_switches', 0)} sampler switches)")


def _make_arm(name: str, config: ServerConfig, args: argparse.Namespace, server: Path | None,
              lib: Path, trace_dir: Path | None = None) -> ServerArm:
    if name == "kvrt":
        trace = ["--step-trace", str(trace_dir)] if trace_dir is not None else []
        return kvrt_arm(replace(config, extra=shlex.split(args.kvrt_args) + trace))
    assert server is not None
    extra = [*(ROOMY_SERVER_ARGS if name == ROOMY else ()), *shlex.split(args.server_args)]
    return llama_server_arm(replace(config, extra=extra), server, lib,
                            unified=name == "llama-server-unified", name=name)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise KvrtError(f"--rounds {args.rounds}: at least one")
    preset = PRESETS[args.preset]
    arms = [a for a in args.arms.split(",") if a] + (["llama-server-unified"] if args.kv_unified else []) + (
        [ROOMY] if args.roomy else [])
    if not arms or set(arms) - {*ARMS, "llama-server-unified", ROOMY}:
        raise KvrtError(f"--arms {args.arms!r}: pick from {', '.join(ARMS)}")
    agents = [int(n) for n in (args.agents or preset["agents"]).split(",")]
    if any(n < 1 for n in agents):
        raise KvrtError(f"--agents {args.agents!r}: every N must be positive")
    sizes = workload_sizes(args)
    path = Path(args.model) if args.model else demo_model_path()
    lib = llama_lib_dir()
    server = find_llama_server(args.llama_server) if any(a.startswith("llama-server") for a in arms) else None
    bench = find_batched_bench(args.batched_bench, server) if server else None
    out = Path(args.out) / "peer"
    trace_dir = out / "steps" / "server" if args.step_trace else None  # the kvrt server's own file, sliced per workload
    (out / "logs").mkdir(parents=True, exist_ok=True)
    vocabulary = safe_vocabulary(path)
    verdict = safe_extra_bufts()
    results: dict[str, Any] = {
        "machine": machine(), "command": " ".join(["kvrt bench peer", *sys.argv[3:]]), "model": path.name,
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "sizes": {name: asdict(s) | {"cells_per_agent": s.cells_per_agent} for name, s in sizes.items()},
        "binaries": {"llama-server": str(server) if server else None,
                     "llama-batched-bench": str(bench) if bench else None, "libllama_dir": str(lib)},
        "extra_bufts": {"use": verdict.use_extra_bufts, "reason": verdict.reason}, "libraries": {}, "ideal": {}}
    rows: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    replies: dict[tuple[int, str, str], list[TurnResult]] = {}
    for n in agents:
        workloads = {name: build(name, s, n, vocabulary, args.seed) for name, s in sizes.items()}
        config = server_config(args, n, sizes, path, verdict.use_extra_bufts)
        log(f"N={n}: {config.cells} cells, n_batch {config.n_batch}, flash attention {config.flash_attn}, "
            f"{path.name}, {config.repack_flag()}; workloads "
            + ", ".join(f"{w} {s.cells_per_agent} cells/agent" for w, s in sizes.items()))
        roomy = replace(config, cells=max(config.cells, auto_cells(n, sizes)))
        short = [w for w, s in sizes.items() if _skip_reason("llama-server", config, s)]
        ran = [a for a in arms if a != ROOMY or short]  # the roomy arm only where llama-server cannot run
        for k in range(args.rounds):
            for name in ran if k % 2 == 0 else ran[::-1]:
                arm = _make_arm(name, roomy if name == ROOMY else config, args, server, lib, trace_dir)
                with arm:
                    arm.start(out / "logs" / f"{name}-n{n}-r{k}.log", args.start_timeout_s)
                    results["libraries"][name] = arm.libraries
                    _warm(arm, vocabulary, args.request_timeout_s)
                    for wname, workload in workloads.items():
                        base = {"n": n, "round": k, "arm": name, "workload": wname, "cells": config.cells}
                        reason = _skip_reason(name, config, workload.sizes)
                        if reason:
                            log(f"  {name:>20} {wname:>8}: skipped ({reason})")
                            rows.append(base | {"skipped": reason})
                            continue
                        trace = ((trace_dir / f"{path.stem}.jsonl",
                                  out / "steps" / f"n{n}-r{k}-{wname}.jsonl")
                                 if trace_dir is not None and name == "kvrt" else None)
                        row, turns = _measure(arm, workload, args.request_timeout_s, trace)
                        rows.append(base | row)
                        replies[(n, wname, name)] = turns
                        start = min(r.sent_s for r in turns)
                        requests += [base | _request_row(r, start) for r in turns]
        if bench is not None:
            results["ideal"][str(n)] = {
                w: batched_bench(bench, lib, roomy if args.roomy and w in short else config, s.first_prompt_tokens(),
                                 s.gen * s.turns, s.shared > 0, args.bench_timeout_s) for w, s in sizes.items()}
            for w, ideal in results["ideal"][str(n)].items():
                layout = f", {ideal['layout']} KV" if "layout" in ideal else ""
                log(f"  {'ideal':>20} {w:>8}: " + (f"{ideal['t_s']:7.2f} s (batched-bench{layout})" if "t_s" in ideal
                                                     else f"skipped ({ideal['skipped']})"))
    results["summary"] = summarise(rows, results["ideal"], replies)
    results["rounds"] = rows
    write_csv(out / "peer.csv", rows)
    write_csv(out / "requests.csv", requests)
    write_json(out / "peer.json", results)
    draw(plot_walls, str(out / "peer.json"), str(out / "peer.png"))
    lost = sum(r.get("lost_tokens", 0) for r in rows)
    log(f"{out / 'peer.json'}; lost output tokens: {lost}")
    return 1 if lost else 0


def _request_row(r: TurnResult, start: float) -> dict[str, Any]:
    """One request's row of requests.csv; ``sent_ms`` and ``end_ms`` count from the workload's first request
    (``start``), so an agent's next ``sent_ms`` less its last ``end_ms`` is the client's own time between turns."""
    return {"agent": r.agent, "turn": r.turn + 1, "prompt_tokens": r.prompt_tokens, "ttft_ms": r.ttft_ms,
            "latency_ms": (r.end_s - r.sent_s) * 1e3, "sent_ms": (r.sent_s - start) * 1e3,
            "end_ms": (r.end_s - start) * 1e3, "received": r.received, "reported": r.reported,
            "completion_ids": len(r.tokens),
            "cached": r.cached, "retokenized": r.retokenized, "error": r.error}


def summarise(rows: list[dict[str, Any]], ideal: dict[str, Any],
              replies: dict[tuple[int, str, str], list[TurnResult]]) -> dict[str, Any]:
    """Per N and workload: each arm's figures over the rounds, kvrt / llama-server ratios (same round), the
    ideal's seconds over kvrt's, and how many of kvrt's output tokens llama-server produced too."""
    out: dict[str, Any] = {}
    for n in sorted({r["n"] for r in rows}):
        for w in dict.fromkeys(r["workload"] for r in rows):
            ran = {a: sorted((r for r in rows if r["n"] == n and r["workload"] == w and r["arm"] == a
                              and "skipped" not in r), key=lambda r: r["round"])
                   for a in dict.fromkeys(r["arm"] for r in rows)}
            point: dict[str, Any] = {a: {key: summarize(r[key] for r in got).as_dict() for key in got[0]
                                         if key.startswith(("wall_s", "output_tokens_per_s", "ttft_"))}
                                     for a, got in ran.items() if got}
            kvrt, peer = ran.get("kvrt", []), ran.get("llama-server", [])
            roomy = ran.get(ROOMY, [])
            if kvrt and len(kvrt) == len(roomy):
                point["kvrt_over_llama_server_roomy_wall"] = ratios([r["wall_s"] for r in kvrt],
                                                                    [r["wall_s"] for r in roomy]).as_dict()
            if kvrt and len(kvrt) == len(peer):
                point["kvrt_over_llama_server_wall"] = ratios([r["wall_s"] for r in kvrt],
                                                              [r["wall_s"] for r in peer]).as_dict()
                point["kvrt_over_llama_server_tokens_per_s"] = ratios(
                    [r["output_tokens_per_s"] for r in kvrt], [r["output_tokens_per_s"] for r in peer]).as_dict()
                point["token_agreement"] = token_agreement(replies[(n, w, "kvrt")], replies[(n, w, "llama-server")])
            bound = ideal.get(str(n), {}).get(w, {})
            if kvrt and "t_s" in bound:
                point["ideal_over_kvrt_wall"] = summarize(bound["t_s"] / r["wall_s"] for r in kvrt).as_dict()
            out[f"N={n} {w}"] = point
    return out


def plot_walls(json_path: str, png_path: str) -> None:
    """Bars of the median wall time per workload (and N) per arm, the ideal beside them (a child process)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    rows = [r for r in data["rounds"] if "skipped" not in r]
    points = list(dict.fromkeys(f"N={r['n']} {r['workload']}" for r in data["rounds"]))
    arms = list(dict.fromkeys(r["arm"] for r in data["rounds"])) + ["ideal"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(points)), 4.0))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        values = []
        for point in points:
            n, w = point.split(" ")
            if arm == "ideal":
                values.append(data["ideal"].get(n[2:], {}).get(w, {}).get("t_s", 0.0))
                continue
            walls = sorted(r["wall_s"] for r in rows if r["arm"] == arm and f"N={r['n']} {r['workload']}" == point)
            values.append(walls[len(walls) // 2] if walls else 0.0)
        ax.bar([i + (j - (len(arms) - 1) / 2) * width for i in range(len(points))], values, width, label=arm)
    ax.set_xticks(range(len(points)), points)
    ax.set_ylabel("wall time, s (lower is better; 0: skipped)")
    ax.set_title(f"kvrt vs llama-server, {data['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
