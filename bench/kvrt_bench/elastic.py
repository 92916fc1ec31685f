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
import heapq
import json
import platform
import statistics
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvrt.memory.elastic import ElasticPool, ElasticRefusal
from kvrt.memory.elastic_kv import ElasticKV, KVLayout
from kvrt_bench._plotting import draw

HELP = ("elastic KV memory: VMM page costs, a SIMULATED bursty multi-model trace (static vs elastic; the measured run "
        "is `kvrt bench multimodel`), elastic llama.cpp contexts")
SIMULATION_ASSUMES = (
    "no model runs: compute is modelled (prefill us/token and decode ms/token per model from H200 measurements, "
    "scaled by weight size), identically in both arms",
    "only the memory operations are real and timed (static: cudaMalloc + cudaMemset of a model's whole max KV; "
    "elastic: VMM page map/unmap); on --driver host they are Python bookkeeping and a scaled-down host array",
    "up to --slots concurrent requests per model, models and requests side by side without compute contention",
    "weights resident and outside the cap; time is virtual (an event queue), not a wall clock",
)

MiB = 1 << 20
GiB = 1 << 30
IDLE_TARGET = 128  # part b: pages the elastic pool keeps created ahead (256 MiB); twice that stay parked


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


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _summary_us(values_s: list[float]) -> dict[str, float]:
    us = [v * 1e6 for v in values_s]
    return {"n": len(us), "p50_us": _pct(us, 50), "p99_us": _pct(us, 99), "mean_us": statistics.fmean(us) if us else 0}


def _driver(kind: str, page_bytes: int = 2 * MiB) -> Any:
    from kvrt.memory.vmm import CudaDriver, HostDriver

    # the trace never reads the KV: poisoning unmapped pages would only commit host memory
    return CudaDriver() if kind == "cuda" else HostDriver(page_bytes, poison=False)


# -- part a -------------------------------------------------------------------------------


def part_a(args: argparse.Namespace) -> dict[str, Any]:
    driver = _driver(args.driver)
    page, n = driver.page_bytes, args.pages
    va = driver.reserve(n * page)
    times: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    handles = []
    for _ in range(n):
        t0 = time.perf_counter()
        handles.append(driver.create_page())
        times["create"].append(time.perf_counter() - t0)
    for i, handle in enumerate(handles):
        t0 = time.perf_counter()
        driver.map_page(va + i * page, handle)
        t1 = time.perf_counter()
        driver.set_access(va + i * page, page)
        t2 = time.perf_counter()
        times["map"].append(t1 - t0)
        times["set_access"].append(t2 - t1)
    for i in range(n):
        t0 = time.perf_counter()
        driver.unmap_page(va + i * page)
        times["unmap"].append(time.perf_counter() - t0)
    for handle in handles:
        t0 = time.perf_counter()
        driver.release_page(handle)
        times["release"].append(time.perf_counter() - t0)
    driver.free_reservation(va, n * page)
    per_call = {k: _summary_us(v) for k, v in times.items()}

    def supply(ahead: int, idle: int) -> dict[str, float]:
        pool = ElasticPool(driver, map_ahead_stripes=ahead, idle_target_pages=idle, idle_max_pages=max(idle, 1))
        tenant = pool.add_tenant("grower", (n + ahead + 1) * page)
        pool.maintain()
        lat = []
        for k in range(1, n + 1):
            t0 = time.perf_counter()
            tenant.grow_to(k * page)
            lat.append(time.perf_counter() - t0)
            if ahead or idle:
                pool.maintain()  # the filler's work, between crossings and untimed
        shrink = []
        for k in range(n - 1, -1, -1):
            t0 = time.perf_counter()
            tenant.shrink_to(k * page)
            shrink.append(time.perf_counter() - t0)
        pool.close()
        return {**_summary_us(lat), "shrink_p50_us": _pct([s * 1e6 for s in shrink], 50),
                "shrink_p99_us": _pct([s * 1e6 for s in shrink], 99)}

    result = {
        "page_bytes": page,
        "per_call": per_call,
        "supply": {
            "pre_mapped": supply(ahead=1, idle=0),
            "pre_created_not_mapped": supply(ahead=0, idle=n + 1),
            "cold": supply(ahead=0, idle=0),
        },
    }
    for name, row in per_call.items():
        print(f"  {name:>11}: p50 {row['p50_us']:8.1f} us  p99 {row['p99_us']:8.1f} us")
    for name, row in result["supply"].items():
        print(f"  supply {name:>22}: p50 {row['p50_us']:8.1f} us  p99 {row['p99_us']:8.1f} us")
    return result


# -- part b -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceModel:
    """A model of the trace: its KV geometry and its modelled compute speed."""

    name: str
    layout: KVLayout
    prefill_us_per_token: float
    decode_ms_per_token: float

    @property
    def max_kv_bytes(self) -> int:
        return self.layout.kv_bytes(self.layout.max_tokens)


# Modelled compute. Qwen2.5-7B shape: prefill of 3,501 tokens took 150-197 ms and 32,000
# tokens 2,073 ms on the H200 (device notes) -> ~60 us/token; decode ~12 ms/token there.
# The 1B and 8B shapes are scaled by weight bytes (1.2 GB, 15.2 GB, 16 GB at F16).
SHAPES = (
    ("llama3.2-1b", 16, 8, 64, 10.0, 2.0),
    ("qwen2.5-7b", 28, 4, 128, 60.0, 12.0),
    ("llama3.1-8b", 32, 8, 128, 64.0, 13.0),
)


def trace_models(count: int, max_ctx: int) -> list[TraceModel]:
    models = []
    for i in range(count):
        name, layers, kv_heads, head_dim, prefill_us, decode_ms = SHAPES[i % len(SHAPES)]
        models.append(TraceModel(f"{name}#{i}", KVLayout(layers, kv_heads, head_dim, max_ctx), prefill_us, decode_ms))
    return models


@dataclass(order=True)
class Request:
    arrival: float
    model: int = field(compare=False)
    prompt: int = field(compare=False)
    output: int = field(compare=False)
    start: float = field(default=0.0, compare=False)
    ttft: float = field(default=0.0, compare=False)
    mem_wait: bool = field(default=False, compare=False)  # was held back because memory was short


def bursty_trace(models: list[TraceModel], duration_s: float, load: float, seed: int) -> list[Request]:
    """Per model: idle gaps (exponential, mean 60 s / load) then bursts of 1-8 requests 0.5 s apart on average.

    Prompts are 256-8192 tokens (log-uniform), outputs 32-256 tokens; all capped at the max context.
    """
    rng = np.random.default_rng(seed)
    requests = []
    for m, model in enumerate(models):
        t = float(rng.exponential(60.0 / load))
        while t < duration_s:
            for _ in range(int(rng.integers(1, 9))):
                prompt = int(np.exp(rng.uniform(np.log(256), np.log(8192))))
                output = int(rng.integers(32, 257))
                prompt = min(prompt, model.layout.max_tokens - output)
                requests.append(Request(t, m, prompt, output))
                t += float(rng.exponential(0.5 / load))
            t += float(rng.exponential(60.0 / load))
    return sorted(requests)


class StaticArena:
    """Static reservation: a resident model holds its max KV, allocated and cleared like llama.cpp's context."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._held: dict[int, Any] = {}

    def allocate(self, m: int, nbytes: int) -> float:
        t0 = time.perf_counter()
        if self.kind == "cuda":
            import cupy

            ptr = cupy.cuda.runtime.malloc(nbytes)
            cupy.cuda.runtime.memset(ptr, 0, nbytes)
            cupy.cuda.runtime.deviceSynchronize()
            self._held[m] = ptr
        else:
            self._held[m] = np.zeros(nbytes // 4096, dtype=np.uint8)  # host stand-in, scaled down
        return time.perf_counter() - t0

    def free(self, m: int) -> None:
        ptr = self._held.pop(m)
        if self.kind == "cuda":
            import cupy

            cupy.cuda.runtime.free(ptr)

    def close(self) -> None:
        for m in list(self._held):
            self.free(m)


def simulate(arm: str, models: list[TraceModel], trace: list[Request], cap: int, kind: str,
             pool_driver: Any, slots: int) -> dict[str, Any]:
    """Run ``trace`` through one arm in virtual time; memory operations are real and timed.

    Each model serves up to ``slots`` requests at once whose tokens together fit its max
    context (the same rule in both arms). Static: the model must be resident (hold its
    max KV); idle resident models are evicted, least recently used first, to make room.
    Elastic: each request slot is a tenant; a request maps its tokens' pages at start.
    """
    n = len(models)
    queues: list[deque[Request]] = [deque() for _ in range(n)]
    active = [0] * n
    tokens_in_use = [0] * n
    last_used = [0.0] * n
    held_bytes = [0] * n
    resident: set[int] = set()
    timeline: list[tuple[float, int]] = [(0.0, 0)]
    events: list[tuple[float, int, str, Any]] = []
    counter = 0
    done: list[Request] = []
    mem_op_s: list[float] = []
    pool: ElasticPool | None = None
    free_slots: list[list[ElasticKV]] = []
    arena = StaticArena(kind) if arm == "static" else None
    if arm == "elastic":
        pool = ElasticPool(pool_driver, capacity_bytes=cap, idle_target_pages=IDLE_TARGET, idle_max_pages=2 * IDLE_TARGET,
                           park_s=0.0, map_ahead_stripes=0)
        free_slots = [[ElasticKV(pool, f"{model.name}/{j}", model.layout) for j in range(slots)] for model in models]

    def push(t: float, what: str, data: Any) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, what, data))

    def record(now: float) -> None:
        if pool is not None:
            stats = pool.stats()
            timeline.append((now, (stats.mapped_pages + stats.idle_pages) * stats.page_bytes))
        else:
            timeline.append((now, sum(held_bytes)))

    def make_resident(m: int) -> float | None:
        """Static arm: seconds to allocate ``m``'s max KV, or ``None`` when it cannot fit yet."""
        need = models[m].max_kv_bytes
        while sum(held_bytes) + need > cap:
            idle = [r for r in resident if not active[r] and not queues[r]]
            if not idle:
                return None
            victim = min(idle, key=lambda r: last_used[r])
            arena.free(victim)
            resident.discard(victim)
            held_bytes[victim] = 0
        cost = arena.allocate(m, need)
        resident.add(m)
        held_bytes[m] = need
        return cost

    def try_start(m: int, now: float) -> None:
        model = models[m]
        while queues[m] and active[m] < slots:
            req = queues[m][0]
            need = req.prompt + req.output
            if tokens_in_use[m] + need > model.layout.max_tokens:
                return
            if arm == "elastic":
                kv = free_slots[m][-1]
                t0 = time.perf_counter()
                try:
                    kv.reserve(need)
                except ElasticRefusal:
                    for waiting in queues[m]:
                        waiting.mem_wait = True
                    return
                cost = time.perf_counter() - t0
                free_slots[m].pop()
                slot: ElasticKV | None = kv
            else:
                cost = 0.0 if m in resident else make_resident(m)
                if cost is None:
                    for waiting in queues[m]:
                        waiting.mem_wait = True
                    return
                slot = None
            queues[m].popleft()
            mem_op_s.append(cost)
            active[m] += 1
            tokens_in_use[m] += need
            prefill_s = req.prompt * model.prefill_us_per_token * 1e-6
            req.start = now
            req.ttft = now + cost + prefill_s - req.arrival
            push(now + cost + prefill_s + req.output * model.decode_ms_per_token * 1e-3, "finish", (m, req, slot))
            record(now)

    def oldest_first() -> list[int]:
        return sorted((i for i in range(n) if queues[i]), key=lambda i: queues[i][0].arrival)

    for req in trace:  # each arm serves its own copies of the same requests
        push(req.arrival, "arrive", replace(req, start=0.0, ttft=0.0, mem_wait=False))
    while events:
        now, _, what, data = heapq.heappop(events)
        if what == "arrive":
            queues[data.model].append(data)
            try_start(data.model, now)
            continue
        m, req, slot = data
        active[m] -= 1
        tokens_in_use[m] -= req.prompt + req.output
        last_used[m] = now
        done.append(req)
        if slot is not None:
            slot.truncate(0)
            free_slots[m].append(slot)
            pool.maintain()
        record(now)
        for i in oldest_first():
            try_start(i, now)
    if pool is not None:
        for kv in (kv for group in free_slots for kv in group):
            kv.close()
        pool.close()
    else:
        arena.close()
    ttft = [r.ttft for r in done]
    waits = [r.start - r.arrival for r in done]
    return {
        "arm": arm, "requests": len(done), "unserved": len(trace) - len(done),
        "ttft_p50_ms": _pct(ttft, 50) * 1e3, "ttft_p99_ms": _pct(ttft, 99) * 1e3,
        "wait_p50_ms": _pct(waits, 50) * 1e3, "wait_p99_ms": _pct(waits, 99) * 1e3,
        "queued_fraction": float(np.mean([w > 1e-9 for w in waits])) if waits else 0.0,
        "mem_wait_fraction": float(np.mean([r.mem_wait for r in done])) if done else 0.0,
        "mem_wait_p99_ms": _pct([r.start - r.arrival for r in done if r.mem_wait] or [0.0], 99) * 1e3,
        "mem_op_p50_us": _pct([c * 1e6 for c in mem_op_s], 50), "mem_op_p99_us": _pct([c * 1e6 for c in mem_op_s], 99),
        "peak_bytes": max(b for _, b in timeline), "timeline": timeline,
    }


def idle_coresidence(models: list[TraceModel], cap: int, driver: Any, probe: int) -> dict[str, int]:
    """Static: models whose maxima fit the cap, in trace order. Elastic: idle tenants reserved side by side."""
    static, used = 0, 0
    for model in models:
        if used + model.max_kv_bytes <= cap:
            used += model.max_kv_bytes
            static += 1
    pool = ElasticPool(driver, capacity_bytes=cap)
    tenants = []
    try:
        for i in range(probe):
            model = models[i % len(models)]
            tenants.append(ElasticKV(pool, f"idle{i}", model.layout))
    except Exception as exc:  # the VA space (or the driver) ran out: report how far it got
        print(f"  idle probe stopped at {len(tenants)} tenants: {exc}")
    elastic = len(tenants)
    held = pool.stats().mapped_pages
    for kv in tenants:
        kv.close()
    pool.close()
    return {"static_models": static, "elastic_idle_tenants": elastic, "elastic_idle_mapped_pages": held,
            "probe_limit": probe}


def part_b(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    print("  SIMULATION (no model runs; what it assumes: " + "; ".join(SIMULATION_ASSUMES) + ")")
    models = trace_models(args.models, args.max_ctx)
    cap = int(args.cap_gib * GiB)
    driver = _driver(args.driver)
    coresident = idle_coresidence(models, cap, driver, args.idle_probe)
    print(f"  idle co-resident under {args.cap_gib} GiB: static {coresident['static_models']}, "
          f"elastic {coresident['elastic_idle_tenants']} (of {args.idle_probe} tried)")
    rows = []
    timelines = {}
    for load in (float(x) for x in args.loads.split(",")):
        trace = bursty_trace(models, args.duration_s, load, args.seed)
        for arm in ("static", "elastic"):
            result = simulate(arm, models, trace, cap, args.driver, driver, args.slots)
            timelines[(arm, load)] = result.pop("timeline")
            rows.append({"load": load, **result})
            print(f"  load {load:>4}: {arm:>7} {result['requests']} req ({result['unserved']} never served), "
                  f"TTFT p50 {result['ttft_p50_ms']:9.1f} ms p99 {result['ttft_p99_ms']:9.1f} ms, queued "
                  f"{result['queued_fraction']:.0%} (for memory {result['mem_wait_fraction']:.1%}), "
                  f"mem op p99 {result['mem_op_p99_us'] / 1e3:.2f} ms, peak {result['peak_bytes'] / GiB:.2f} GiB")
    draw(_plot_memory, timelines, cap, out / "elastic-b-simulation-memory.png")
    with (out / "elastic-b-simulation-memory.csv").open("w") as fh:
        fh.write("arm,load,t_s,bytes\n")
        for (arm, load), points in timelines.items():
            fh.writelines(f"{arm},{load},{t:.6f},{b}\n" for t, b in points)
    # "Starts to queue": the lowest load at which more than --queue-threshold of the static
    # arm's requests were held back for memory (their model was not resident and no idle
    # model could be evicted to make room). Waits for a slot of a busy model are not counted:
    # both arms have them alike.
    static_rows = sorted((r for r in rows if r["arm"] == "static"), key=lambda r: r["load"])
    first_queue = next((r["load"] for r in static_rows if r["mem_wait_fraction"] > args.queue_threshold), None)
    headline: dict[str, Any] = {"queue_threshold": args.queue_threshold, "load": first_queue}
    for r in static_rows:
        e = next(x for x in rows if x["arm"] == "elastic" and x["load"] == r["load"])
        print(f"  load {r['load']:>4}: static waits for memory {r['mem_wait_fraction']:.1%} "
              f"(elastic {e['mem_wait_fraction']:.1%}); p99 TTFT static/elastic "
              f"{r['ttft_p99_ms'] / e['ttft_p99_ms']:.2f}x")
    if first_queue is not None:
        s = next(r for r in static_rows if r["load"] == first_queue)
        e = next(r for r in rows if r["arm"] == "elastic" and r["load"] == first_queue)
        headline.update(static_mem_wait_fraction=s["mem_wait_fraction"], static_ttft_p99_ms=s["ttft_p99_ms"],
                        elastic_ttft_p99_ms=e["ttft_p99_ms"], p99_ttft_ratio=s["ttft_p99_ms"] / e["ttft_p99_ms"])
        print(f"  static starts to queue (> {args.queue_threshold:.0%} of its requests wait for memory) at load "
              f"{first_queue} ({s['mem_wait_fraction']:.1%}): p99 TTFT static {s['ttft_p99_ms']:.1f} ms / elastic "
              f"{e['ttft_p99_ms']:.1f} ms = {headline['p99_ttft_ratio']:.2f}x (target >= 3x)")
    else:
        print(f"  static never has > {args.queue_threshold:.0%} of its requests waiting for memory at these loads: "
              f"the trace does not reach the regime the target is about (raise --loads, --models or --max-ctx)")
    return {"simulation": True, "assumes": list(SIMULATION_ASSUMES), "cap_bytes": cap,
            "models": [asdict(m) | {"max_kv_bytes": m.max_kv_bytes} for m in models],
            "idle_coresidence": coresident, "rows": rows, "headline": headline}


def _plot_memory(timelines: dict[tuple[str, float], list[tuple[float, int]]], cap: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  matplotlib missing: no plot")
        return
    loads = sorted({load for _, load in timelines})
    fig, axes = plt.subplots(len(loads), 1, figsize=(9, 2.4 * len(loads)), sharex=True, squeeze=False)
    for ax, load in zip(axes[:, 0], loads):
        for arm in ("static", "elastic"):
            points = timelines[(arm, load)]
            ax.step([t for t, _ in points], [b / GiB for _, b in points], where="post", label=arm)
        ax.axhline(cap / GiB, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylabel(f"GiB (load {load})")
    axes[0, 0].legend(loc="upper right")
    axes[-1, 0].set_xlabel("trace time (virtual s)")
    fig.suptitle("SIMULATION (compute modelled): KV memory held, static reservation vs elastic pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- part c -------------------------------------------------------------------------------


ELASTIC_ARMS = {
    # name: (expected_tokens at registration, prepare() a spare between turns, use --grow-ahead between turns)
    "spare": (True, True, True),
    "spare-no-ahead": (True, True, False),
    "cold": (False, False, True),
}


def _final_bucket(n_tokens: int, min_ctx: int = 256) -> int:
    size = min_ctx
    while size < n_tokens:
        size *= 2
    return size


def part_c(args: argparse.Namespace) -> dict[str, Any]:
    from kvrt.engine.context import Context
    from kvrt.engine.generation import GenerationParams, generate
    from kvrt.engine.model import Model
    from kvrt.memory.elastic_context import ElasticContext

    path = args.model
    if not path:
        from kvrt.modelfiles.testmodels import write_model

        path = str(write_model(Path(tempfile.mkdtemp()) / "tiny.gguf", "tiny", seed=args.seed))
    model = Model(path, n_gpu_layers=args.n_gpu_layers)
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(3, min(model.n_vocab, 32000), args.prompt_tokens)]
    prompt[0] = 1  # BOS
    params = GenerationParams(max_tokens=args.gen_tokens)
    split = max(1, args.prompt_tokens // 4)
    turns = [prompt[:split], prompt[split:]]  # turn 2's growth carries turn 1's state
    # the agent's maximum and the fixed arm's size: the bucket holding both turns and their generations
    final_ctx = _final_bucket(args.prompt_tokens + 2 * args.gen_tokens)
    first_need = len(turns[0]) + args.gen_tokens  # what registration is told the first request needs
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ELASTIC_ARMS]
    if unknown or not arms:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {sorted(ELASTIC_ARMS)}")
    runs: dict[str, list[dict[str, float]]] = {"fixed": [], **{a: [] for a in arms}}
    tokens: dict[str, list[list[int]]] = {}
    moves_seen: dict[str, list[dict[str, Any]]] = {}
    spares_seen: dict[str, list[dict[str, Any]]] = {}

    def two_turns(arm: str, complete: Any, between: Any = None) -> None:
        """Both turns; every request's wait is inside its ``complete`` (growth included); ``between`` is timed apart."""
        prefill_ms = decode_ms = request_ms = between_ms = 0.0
        generated: list[list[int]] = []
        t0 = time.perf_counter()
        for i, turn in enumerate(turns):
            if i and between is not None:
                tb = time.perf_counter()
                between()  # the agent's idle time between turns: off the critical path
                between_ms += (time.perf_counter() - tb) * 1e3
            tr = time.perf_counter()
            done = complete(turn)
            request_ms += (time.perf_counter() - tr) * 1e3
            prefill_ms += done.timings_ms["prefill_ms"]
            decode_ms += done.timings_ms["decode_ms"]
            generated.append(done.tokens)
        tokens.setdefault(arm, generated)
        if generated != tokens[arm]:
            tokens[arm] = []  # repeats disagree: never counts as equal
        n = max(sum(len(g) for g in generated), 1)
        runs[arm].append({"prefill_ms": prefill_ms, "ms_per_token": decode_ms / n, "request_ms": request_ms,
                          "between_ms": between_ms, "total_ms": (time.perf_counter() - t0) * 1e3})

    for _ in range(args.repeats):
        for arm in arms:
            expect, spare, ahead = ELASTIC_ARMS[arm]
            t_reg = time.perf_counter()
            agent = ElasticContext(model, max_ctx=final_ctx, min_ctx=256,
                                   expected_tokens=first_need if expect else None)
            registration_ms = (time.perf_counter() - t_reg) * 1e3
            registration_spare_ms = sum(sp.create_s for sp in agent.spares) * 1e3
            with agent:
                def between(agent: ElasticContext = agent, spare: bool = spare, ahead: bool = ahead) -> None:
                    if ahead and args.grow_ahead > 0:
                        agent.grow_ahead(args.grow_ahead)
                    if spare:
                        agent.prepare()  # keep one spare of the next bucket (none at max_ctx)

                two_turns(arm, lambda turn, agent=agent: agent.generate(turn, params), between)
                # what is still held after the last turn stays held until the agent closes (not timed: not growth)
                held_after = [(sp.nbytes, agent.spare_held_s()) for sp in agent.spares if sp.outcome == "held"]
                final = agent.n_ctx
            on = [r for r in agent.resizes if r.on_path]
            off = [r for r in agent.resizes if not r.on_path]
            spare_create_ms = sum(sp.create_s for sp in agent.spares) * 1e3
            runs[arm][-1].update(
                growth_ms=sum(r.seconds for r in on) * 1e3, moves=len(on),
                on_path_create_ms=sum(r.create_s for r in on) * 1e3,
                on_path_empty_ms=sum(r.seconds for r in on if not r.n_tokens) * 1e3,
                on_path_spare_moves=sum(r.spare for r in on),
                off_path_move_ms=sum(r.seconds for r in off) * 1e3, off_path_moves=len(off),
                spare_create_ms=spare_create_ms, off_path_ms=sum(r.seconds for r in off) * 1e3 + spare_create_ms,
                registration_ms=registration_ms, registration_spare_ms=registration_spare_ms,
                spares=len(agent.spares), spares_used=sum(sp.outcome == "used" for sp in agent.spares),
                spare_peak_mb=max((sp.nbytes for sp in agent.spares), default=0) / 1e6,
                spare_held_ms=sum(sp.held_s for sp in agent.spares) * 1e3,
                spare_mb_s=sum(sp.nbytes * sp.held_s for sp in agent.spares) / 1e6,
                spare_held_after_mb=sum(b for b, _ in held_after) / 1e6,
                moved_state_mb=sum(r.state_bytes for r in agent.resizes) / 1e6, final_ctx=final)
            moves_seen[arm] = [{"from": r.from_ctx, "to": r.to_ctx, "tokens": r.n_tokens,
                                "state_mb": r.state_bytes / 1e6, "ms": r.seconds * 1e3, "on_path": r.on_path,
                                "spare": r.spare, "capture_ms": r.capture_s * 1e3, "create_ms": r.create_s * 1e3,
                                "restore_ms": r.restore_s * 1e3, "close_ms": r.close_s * 1e3} for r in agent.resizes]
            spares_seen[arm] = [{"n_ctx": sp.n_ctx, "mb": sp.nbytes / 1e6, "create_ms": sp.create_s * 1e3,
                                 "held_ms": sp.held_s * 1e3, "outcome": sp.outcome} for sp in agent.spares]
        t_reg = time.perf_counter()
        ctx = Context(model, n_ctx=final_ctx)
        registration_ms = (time.perf_counter() - t_reg) * 1e3
        with ctx:
            two_turns("fixed", lambda turn, ctx=ctx: generate(ctx, turn, params))
            runs["fixed"][-1].update(registration_ms=registration_ms)
    model.close()
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}
    best = {arm: {k: min(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}  # least disturbed run
    f = med["fixed"]
    per_arm = {}
    for arm in arms:
        e = med[arm]
        per_arm[arm] = {
            "tokens_equal": bool(tokens[arm]) and tokens[arm] == tokens["fixed"],
            "tpot_ratio_elastic_over_fixed": e["ms_per_token"] / f["ms_per_token"],
            "growth_over_prefill": e["growth_ms"] / f["prefill_ms"],
            "off_path_over_prefill": e["off_path_ms"] / f["prefill_ms"],
            "best_tpot_ratio": best[arm]["ms_per_token"] / best["fixed"]["ms_per_token"],
            "best_growth_over_prefill": best[arm]["growth_ms"] / best["fixed"]["prefill_ms"],
            "last_run_moves": moves_seen[arm], "last_run_spares": spares_seen[arm],
        }
    head = arms[0]
    result = {
        "model": Path(path).name, "turn_prompt_tokens": [len(t) for t in turns],
        "gen_tokens": [len(g) for g in tokens["fixed"]], "final_ctx": final_ctx, "expected_tokens": first_need,
        "arms": arms, "headline_arm": head,
        "tokens_equal": all(per_arm[a]["tokens_equal"] for a in arms), "median": med, "runs": runs, "best": best,
        "per_arm": per_arm, "grow_ahead_fill": args.grow_ahead,
        # the headline arm's figures under the keys earlier runs used
        **{k: per_arm[head][k] for k in ("tpot_ratio_elastic_over_fixed", "growth_over_prefill",
                                           "off_path_over_prefill", "best_tpot_ratio", "best_growth_over_prefill")},
    }
    print(f"  agent max_ctx = fixed n_ctx = {final_ctx}; turns {result['turn_prompt_tokens']} prompt tokens, "
          f"{args.gen_tokens} generated each; registration told {first_need} tokens where an arm uses expected_tokens")
    print(f"  tokens equal: {result['tokens_equal']} ({', '.join(a + ' ' + str(per_arm[a]['tokens_equal']) for a in arms)}); "
          f"fixed: prefill {f['prefill_ms']:.1f} ms (both turns), {f['ms_per_token']:.3f} ms/token, its {final_ctx}-cell "
          f"context created at registration in {f['registration_ms']:.1f} ms")
    for arm in arms:
        e, r = med[arm], per_arm[arm]
        expect, spare, ahead = ELASTIC_ARMS[arm]
        how = (f"expected_tokens={'yes' if expect else 'no'}, between turns: "
               + (" + ".join(x for x in ((f"grow_ahead({args.grow_ahead:g})" if ahead and args.grow_ahead > 0 else ""),
                                         ("prepare()" if spare else "")) if x) or "nothing"))
        print(f"  [{arm}] ({how})")
        print(f"    ms/token {e['ms_per_token']:.3f} (ratio to fixed {r['tpot_ratio_elastic_over_fixed']:.3f}); "
              f"elastic prefill incl. growth {e['prefill_ms']:.1f} ms; requests waited {e['request_ms']:.1f} ms in all "
              f"(fixed {f['request_ms']:.1f})")
        print(f"    ON the critical path: {e['moves']:.0f} moves ({e['on_path_spare_moves']:.0f} into a prepared spare), "
              f"{e['growth_ms']:.2f} ms = {r['growth_over_prefill']:.1%} of the fixed prefill (target < 5%); of it "
              f"context creation {e['on_path_create_ms']:.2f} ms")
        print(f"    OFF the path: {e['off_path_ms']:.2f} ms = {r['off_path_over_prefill']:.1%} of the fixed prefill "
              f"(spare creation {e['spare_create_ms']:.2f} ms, of it {e['registration_spare_ms']:.2f} ms at registration; "
              f"moves ahead {e['off_path_moves']:.0f}, {e['off_path_move_ms']:.2f} ms); registration in all "
              f"{e['registration_ms']:.1f} ms, between turns {e['between_ms']:.1f} ms")
        print(f"    spares: {e['spares']:.0f} made, {e['spares_used']:.0f} used; largest {e['spare_peak_mb']:.1f} MB "
              f"(ledger charge), held {e['spare_held_ms']:.1f} ms in all = {e['spare_mb_s']:.3f} MB*s; still held after "
              f"the last turn: {e['spare_held_after_mb']:.1f} MB")
        for mv in r["last_run_moves"]:
            print(f"      move {mv['from']:>6} -> {mv['to']:>6} cells carrying {mv['tokens']:>6} tokens "
                  f"({mv['state_mb']:.1f} MB): {mv['ms']:.2f} ms {'on the path' if mv['on_path'] else 'ahead'}"
                  f"{' into a spare' if mv['spare'] else ''} (state out {mv['capture_ms']:.2f}, create context "
                  f"{mv['create_ms']:.2f}, state in {mv['restore_ms']:.2f}, close old {mv['close_ms']:.2f} ms)")
        for sp in r["last_run_spares"]:
            print(f"      spare {sp['n_ctx']:>6} cells, {sp['mb']:.1f} MB: created in {sp['create_ms']:.2f} ms, "
                  f"held {sp['held_ms']:.1f} ms, {sp['outcome']}")
        print(f"    best of {args.repeats}: ms/token ratio {r['best_tpot_ratio']:.3f}, growth/prefill "
              f"{r['best_growth_over_prefill']:.1%}")
    return result


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
