"""``kvrt bench elastic --part b``: a SIMULATED bursty multi-model trace, static reservation vs one elastic pool.

No model runs: the memory operations are real and timed, the compute is modelled
identically in both arms (what it assumes: :data:`SIMULATION_ASSUMES`; the CLI
description in :mod:`kvrt_bench.elastic` says the rest).
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvrt.memory.elastic import ElasticPool, ElasticRefusal
from kvrt.memory.elastic_kv import ElasticKV, KVLayout
from kvrt_bench._elastic_pages import page_driver, pct
from kvrt_bench._plotting import draw

SIMULATION_ASSUMES = (
    "no model runs: compute is modelled (prefill us/token and decode ms/token per model from H200 measurements, "
    "scaled by weight size), identically in both arms",
    "only the memory operations are real and timed (static: cudaMalloc + cudaMemset of a model's whole max KV; "
    "elastic: VMM page map/unmap); on --driver host they are Python bookkeeping and a scaled-down host array",
    "up to --slots concurrent requests per model, models and requests side by side without compute contention",
    "weights resident and outside the cap; time is virtual (an event queue), not a wall clock",
)

GiB = 1 << 30
IDLE_TARGET = 128  # pages the elastic pool keeps created ahead (256 MiB); twice that stay parked


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
        pool = ElasticPool(pool_driver, capacity_bytes=cap, idle_target_pages=IDLE_TARGET,
                           idle_max_pages=2 * IDLE_TARGET, park_s=0.0, map_ahead_stripes=0)
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
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "wait_p50_ms": pct(waits, 50) * 1e3, "wait_p99_ms": pct(waits, 99) * 1e3,
        "queued_fraction": float(np.mean([w > 1e-9 for w in waits])) if waits else 0.0,
        "mem_wait_fraction": float(np.mean([r.mem_wait for r in done])) if done else 0.0,
        "mem_wait_p99_ms": pct([r.start - r.arrival for r in done if r.mem_wait] or [0.0], 99) * 1e3,
        "mem_op_p50_us": pct([c * 1e6 for c in mem_op_s], 50), "mem_op_p99_us": pct([c * 1e6 for c in mem_op_s], 99),
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
    driver = page_driver(args.driver)
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

