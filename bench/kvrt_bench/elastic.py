"""Elastic KV memory: page costs, a bursty multi-model trace, and elastic vs fixed llama.cpp contexts.

``--part a`` (GPU): each CUDA VMM call's cost per 2 MiB page (cuMemCreate, cuMemMap,
cuMemSetAccess, cuMemUnmap, cuMemRelease, each timed alone through
:class:`kvrt.memory.vmm.CudaDriver`, Python call overhead included), then the page supply
latency a tenant sees when ``grow_to`` crosses a page boundary: with the next page
already mapped ahead, with pages created ahead but not mapped, and cold (created on the
critical path). p50/p99 over ``--pages`` crossings each.

``--part b`` (GPU), **a simulation**: no model runs. A bursty trace of requests to several models (KV geometries of
Llama-3.2-1B, Qwen2.5-7B and Llama-3.1-8B, each allowed ``--max-ctx`` tokens) under one
KV memory cap, served two ways. *Static*: a model is resident only while it holds KV
for its whole max context (stock llama.cpp: the context allocates and clears it;
here ``cudaMalloc`` + ``cudaMemset`` of that size, timed); a request to a non-resident
model waits until idle resident models are evicted to make room. *Elastic*: every
model is an :class:`kvrt.memory.elastic_kv.ElasticKV` tenant of one :class:`ElasticPool`
capped at the same bytes; a request maps pages for its tokens when it starts and
returns them when it ends (timed, real VMM calls). What is **modelled**, identically in
both arms: the compute (prefill ``us/token`` and decode ``ms/token`` per model, from
the H200 measurements in the device notes, scaled by weight size), up to ``--slots``
concurrent requests per model whose tokens fit its max context, models and requests
running side by side without compute contention, weights resident and outside the cap,
and the filler's work between events (``maintain()``, untimed). TTFT = queueing +
the timed memory operation + modelled prefill. Swept over ``--loads`` (arrival-rate
multipliers); memory held over time (the static arm's resident maxima; the pool's mapped plus
parked pages, at most ``2 * IDLE_TARGET`` parked) is plotted. A request *waits for memory*
when its model could not start it because memory was short (static: the model is not
resident and every resident model is busy, so none can be evicted; elastic: the pool
refused its pages); static *starts to queue* at the first load where more than
``--queue-threshold`` (5%) of its requests waited for memory, and the p99 TTFT ratio is
reported there (and at every load). Requests a static arm can
never serve (a model whose max KV exceeds the cap) are counted as unserved. Idle co-residence: how many models'
static maxima fit the cap vs how many idle elastic tenants (0 pages each) were
reserved side by side (up to ``--idle-probe``).

``--part c`` (CPU or GPU): the same two-turn agent (a quarter of ``--prompt-tokens``,
then the rest, ``--gen-tokens`` generated after each) in an
:class:`kvrt.memory.elastic_context.ElasticContext` (``max_ctx`` the bucket holding both turns,
starts at 256 cells; turn 2's growth moves turn 1's state) and in a fixed context of that
size: greedy tokens (must be equal), time per generated token, and the growth's time on
the critical path (inside the request: capture, context creation, restore, closing the
old context) against the prefill it accompanies. ``--arms`` picks the elastic variants:
``spare`` (a spare context for the first request created at registration from
``expected_tokens``; between turns ``grow_ahead`` then ``prepare``), ``spare-no-ahead``
(between turns only ``prepare``: turn 2 moves into the spare on its path) and ``cold``
(no spares). Work done off the path (spare creation at registration and between turns,
moves ahead) is timed and reported apart, with the spares' bytes (ledger charge) and how
long each was held. Context creation at registration (the 256-cell context; the fixed
arm's whole context) is timed and reported, not counted as growth.

``--driver host`` runs parts a and b on :class:`kvrt.memory.vmm.HostDriver` to check the
harness on a CPU machine; its times are not GPU results.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from kvrt_bench._elastic_agent import part_c
from kvrt_bench._elastic_pages import part_a
from kvrt_bench._elastic_trace import part_b

HELP = ("elastic KV memory: VMM page costs, a SIMULATED bursty multi-model trace (static vs elastic; the measured run "
        "is `kvrt bench multimodel`), elastic llama.cpp contexts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--part", choices=("a", "b", "c", "all"), default="all")
    parser.add_argument("--driver", choices=("cuda", "host"), default="cuda", help="parts a/b: page driver")
    parser.add_argument("--pages", type=int, default=400, help="part a: pages per measurement")
    parser.add_argument("--cap-gib", type=float, default=16.0, help="part b: KV memory cap for both arms")
    parser.add_argument("--max-ctx", type=int, default=32768, help="part b: each model's maximum context")
    parser.add_argument("--models", type=int, default=12, help="part b: models in the trace (3 shapes, cycled)")
    parser.add_argument("--duration-s", type=float, default=600.0, help="part b: trace length (virtual seconds)")
    parser.add_argument("--loads", default="0.5,1,2,4", help="part b: arrival-rate multipliers")
    parser.add_argument("--slots", type=int, default=8, help="part b: requests one model serves at once")
    parser.add_argument("--idle-probe", type=int, default=256, help="part b: idle elastic tenants to reserve")
    parser.add_argument("--queue-threshold", type=float, default=0.05,
                        help="part b: static 'starts to queue' at the first load where more than this share of its "
                             "requests waits for memory")
    parser.add_argument("--model", default="", help="part c: GGUF path (default: the tiny test model, written)")
    parser.add_argument("--prompt-tokens", type=int, default=3000, help="part c: prompt length")
    parser.add_argument("--gen-tokens", type=int, default=64, help="part c: generated tokens")
    parser.add_argument("--repeats", type=int, default=3, help="part c: runs per arm (median kept)")
    parser.add_argument("--n-gpu-layers", type=int, default=-1, help="part c: layers offloaded")
    parser.add_argument("--grow-ahead", type=float, default=0.5,
                        help="part c: between turns, move to the next bucket once the sequence fills this share of "
                             "its context (off the critical path; 0 disables)")
    parser.add_argument("--arms", default="spare,spare-no-ahead,cold",
                        help="part c: elastic arms, the first is the headline. spare: a spare for the first request "
                             "at registration (expected_tokens), grow-ahead then prepare() between turns; "
                             "spare-no-ahead: the same without grow-ahead (turn 2 moves into the spare on its path); "
                             "cold: no spares (the first request creates its context on its path)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "python": platform.python_version(),
            "driver": args.driver, "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    parts = ("a", "b", "c") if args.part == "all" else (args.part,)
    for part in parts:
        print(f"elastic part {part}:")
        result = {"a": lambda: part_a(args), "b": lambda: part_b(args, out), "c": lambda: part_c(args)}[part]()
        path = out / ("elastic-b-simulation.json" if part == "b" else f"elastic-{part}.json")
        path.write_text(json.dumps({"meta": meta, "result": result}, indent=1, default=str))
        print(f"  wrote {path}")
    return 0
