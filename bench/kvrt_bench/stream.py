"""Layer streaming (seed 003's layer_stream_demo): serial vs two-stream overlapped passes.

Every point streams the same pinned layers through the same two device slots three
ways: serial (copy, then compute, layer after layer), overlapped (the next layer
copies while this one computes) and transfer-only (the bus's peak for these copies,
measured in the same run). The work per layer is the seed's FMA pass
(``--mode fma``: ``--compute-iters`` FMAs per float32) or a real Qwen2.5-7B-shaped
layer over a prefill chunk of ``--tokens`` tokens (``--mode layer``).

Beside the seed's headline it reports what decides whether overlap is working: the
per-layer transfer and compute times T and C from the serial pass, the ideal
speedup (T + C) / max(T, C), the bound for exactly these n layers (the same T_i, C_i
replayed through the plan: pipeline fill and drain included), the efficiency
against both, and the H2D GB/s during the overlapped pass against the transfer-only
peak; and the fraction of the ideal overlapped pass, n x max(T, C) (copies and
computes each serialised on their own stream), with the spread over ``--repeats``
passes. Bounds checked on every run (the run fails past them): fraction of the ideal
<= 1, speed-up <= the n-layer bound. ``--sweep`` walks compute_iters (or tokens)
through the transfer-bound, balanced and compute-bound regimes and adds the
interpolated balanced point T = C.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvrt.stream.layer import LayerShape, fill_random
from kvrt.stream.streamer import LayerStreamer
from kvrt.stream.streamplan import RunTimes, StreamConfig, StreamReport, report
from kvrt.stream.streamwork import FmaWork, LayerWork
from kvrt_bench._bounds import DEFAULT_TOLERANCE, Bound, enforce, ideal_bound
from kvrt_bench._plotting import draw
from kvrt_bench._stats import check_samples

HELP = "layer streaming: serial vs two-stream overlapped copies of pinned layers (FMA or real-layer work)"

SEED_BYTES = 64 << 20
FMA_SWEEP = (64, 256, 1024, 2048, 4096, 8192, 16384)
TOKEN_SWEEP = (256, 1024, 2048, 4096, 8192)
TOKEN_STEP = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n-layers", type=int, default=8, help="layers in the pinned pool (seed: 8)")
    parser.add_argument("--bytes-per-layer", type=int, default=SEED_BYTES,
                        help="FMA mode: bytes per layer (seed: 67108864); layer mode uses the preset's size")
    parser.add_argument("--compute-iters", type=int, default=64, help="FMA mode: FMAs per float32 (seed: 64)")
    parser.add_argument("--mode", choices=("fma", "layer"), default="fma")
    parser.add_argument("--tokens", type=int, default=1024, help="layer mode: prefill chunk B")
    parser.add_argument("--preset", default="qwen2.5-7b",
                        help="layer mode: model shape from kvrt.modelfiles.testmodels")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep compute_iters (fma) or tokens (layer) and add the balanced point")
    parser.add_argument("--sweep-values", default="", help="comma-separated values for --sweep (default: built-in)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per schedule (>= 3; median kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound-tolerance", type=float, default=DEFAULT_TOLERANCE)


def _passes(streamer: LayerStreamer, work: Callable[[int, Any], None], reset: Callable[[], None],
            *, overlapped: bool, repeats: int) -> list[RunTimes]:
    """``repeats`` passes of one schedule, fastest first."""
    passes = []
    for _ in range(repeats):
        reset()
        passes.append(streamer.run(work, overlapped=overlapped))
    return sorted(passes, key=lambda t: t.total_ms)


def measure(streamer: LayerStreamer, work: Any, repeats: int) -> tuple[StreamReport, dict[str, float]]:
    """Warm up (JIT, cuBLAS, memory pool), then the median of ``repeats`` passes of each schedule; with it the
    serial and overlapped passes' min and max (the spread)."""
    for overlapped in (False, True):
        work.reset()
        streamer.run(work, overlapped=overlapped)
    serial = _passes(streamer, work, work.reset, overlapped=False, repeats=repeats)
    overlapped = _passes(streamer, work, work.reset, overlapped=True, repeats=repeats)
    copies = _passes(streamer, lambda layer, slot: None, lambda: None, overlapped=True, repeats=repeats)
    spread = {"passes": repeats, "serial_ms_min": serial[0].total_ms, "serial_ms_max": serial[-1].total_ms,
              "overlapped_ms_min": overlapped[0].total_ms, "overlapped_ms_max": overlapped[-1].total_ms}
    middle = repeats // 2
    return report(serial[middle], overlapped[middle], copies[middle], streamer.config.layer_bytes), spread


def fill_pool(streamer: LayerStreamer, fill: Callable[[Any, int], None]) -> None:
    """Make each layer on the device (fast random numbers) and copy it down into the pinned pool."""
    for i, nbytes in enumerate(streamer.config.layer_bytes):
        view = streamer.slot(0)[:nbytes]
        fill(view, i)
        view.get(out=streamer.host_layer(i))


def balanced_value(points: list[dict[str, Any]], key: str) -> int | None:
    """The sweep value where C crosses T, linearly interpolated between the bracketing points."""
    ordered = sorted(points, key=lambda p: p[key])
    for a, b in zip(ordered, ordered[1:]):
        da, db = a["compute_ms"] - a["transfer_ms"], b["compute_ms"] - b["transfer_ms"]
        if da < 0 <= db:
            return round(a[key] + (b[key] - a[key]) * (-da) / (db - da))
    return None


def _point(r: StreamReport, n_layers: int, spread: dict[str, float], **labels: Any) -> dict[str, Any]:
    """One configuration's figures. The ideal overlapped pass is n x max(T, C): the copies and the computes each
    run one after another on their own stream, so neither total can shrink; fraction_of_ideal = ideal / measured."""
    ideal_ms = n_layers * max(r.transfer_ms, r.compute_ms)
    return {**labels, "n_layers": n_layers, **asdict(r), **spread, "speedup": r.speedup, "savings": r.savings,
            "efficiency": r.efficiency, "pipeline_efficiency": r.pipeline_efficiency, "h2d_fraction": r.h2d_fraction,
            "ideal_overlapped_ms": ideal_ms, "fraction_of_ideal": ideal_ms / r.overlapped_ms}


def stream_bounds(points: list[dict[str, Any]]) -> list[Bound]:
    """Per point: overlapped no faster than n x max(T, C), speed-up no more than the n-layer pipeline bound."""
    bounds = []
    for p in points:
        where = f"stream {p['mode']} n={p['n_layers']} x={p.get('tokens', p.get('compute_iters'))}"
        bounds.append(ideal_bound(f"{where}: fraction of the ideal", p["fraction_of_ideal"],
                                  "n x max(transfer, compute) per layer"))
        bounds.append(Bound(f"{where}: speed-up over serial", p["speedup"], p["pipeline_ideal_speedup"],
                            "a two-slot pipeline over these n layers with the measured T_i, C_i"))
    return bounds


def plot(points: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    pts = sorted(points, key=lambda p: p["compute_ms"] / p["transfer_ms"])
    ratio = [p["compute_ms"] / p["transfer_ms"] for p in pts]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    top.plot(ratio, [p["speedup"] for p in pts], "o-", label="measured")
    top.plot(ratio, [p["ideal_speedup"] for p in pts], "--", label="ideal (T+C)/max(T,C)")
    top.plot(ratio, [p["pipeline_ideal_speedup"] for p in pts], ":", label="bound for these n layers")
    top.set_ylabel("speedup over serial")
    top.legend()
    bottom.plot(ratio, [p["efficiency"] for p in pts], "o-", label="vs ideal")
    bottom.plot(ratio, [p["pipeline_efficiency"] for p in pts], "s-", label="vs n-layer bound")
    bottom.plot(ratio, [p["h2d_fraction"] for p in pts], "^-", label="H2D / pinned peak")
    bottom.axhline(0.95, color="grey", lw=0.8)
    bottom.set_ylabel("fraction")
    bottom.set_xlabel("C / T (compute / transfer per layer); < 1 transfer-bound, > 1 compute-bound")
    bottom.set_xscale("log")
    bottom.legend()
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    check_samples(args.repeats)
    layer_mode = args.mode == "layer"
    shape = LayerShape.preset(args.preset) if layer_mode else None
    bytes_per_layer = shape.nbytes if shape else args.bytes_per_layer
    key, base = ("tokens", args.tokens) if layer_mode else ("compute_iters", args.compute_iters)
    values = [base]
    if args.sweep:
        extra = [int(v) for v in args.sweep_values.split(",") if v] or (TOKEN_SWEEP if layer_mode else FMA_SWEEP)
        values += [v for v in extra if v != base]

    t0 = time.perf_counter()
    with LayerStreamer(StreamConfig.uniform(args.n_layers, bytes_per_layer)) as streamer:
        import cupy as cp  # noqa: PLC0415  (the streamer has just proven it is usable)

        rng = cp.random.default_rng(args.seed)

        def fill(view: Any, layer: int) -> None:
            if shape:
                fill_random(view, shape, args.seed + layer, cp)
            else:
                view.view(cp.float32)[...] = rng.standard_normal(view.size // 4, dtype=cp.float32)

        fill_pool(streamer, fill)
        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
        device = name.decode() if isinstance(name, bytes) else str(name)
        print(f"{args.mode}: {args.n_layers} layers x {bytes_per_layer / 2**20:.1f} MiB pinned on {device} "
              f"(ready in {time.perf_counter() - t0:.1f} s)", flush=True)

        def one(value: int, balanced: bool = False) -> tuple[StreamReport, dict[str, Any]]:
            work = LayerWork(cp, shape, value, seed=args.seed) if shape else FmaWork(cp, bytes_per_layer, value)
            r, spread = measure(streamer, work, args.repeats)
            extra = {"layer_tflops": shape.flops(value) / (r.compute_ms * 1e9)} if shape else {}
            point = _point(r, args.n_layers, spread, mode=args.mode, bytes_per_layer=bytes_per_layer,
                           **{key: value}, balanced=balanced, **extra)
            print(f"[{key}={value}{' balanced' if balanced else ''}] serial={r.serial_ms:.2f} ms "
                  f"overlapped={r.overlapped_ms:.2f} ms speedup={r.speedup:.3f}x | {r.detail()}"
                  + (f" | {extra['layer_tflops']:.0f} TFLOP/s in compute" if extra else ""), flush=True)
            return r, point

        results = [one(v) for v in values]
        if args.sweep:
            target = balanced_value([p for _, p in results], key)
            if target is not None and layer_mode:
                target = max(TOKEN_STEP, round(target / TOKEN_STEP) * TOKEN_STEP)
            if target is not None and target not in values:
                results.append(one(target, balanced=True))
    points = [p for _, p in results]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"stream-{args.mode}-n{args.n_layers}"
    command = {k: v for k, v in vars(args).items() if not callable(v)}
    meta = {"device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        flat = [{k: v for k, v in p.items() if not isinstance(v, tuple)} for p in points]
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    if len(points) > 1:
        draw(plot, points, f"{args.mode}: {args.n_layers} layers x {bytes_per_layer / 2**20:.0f} MiB on {device}",
             stem.with_suffix(".png"))
    print(f"wrote {stem}.json/.csv" + ("/.png" if len(points) > 1 else ""))

    print(f"DETAIL: {args.mode} {key}={base}: {results[0][0].detail()}")
    print(results[0][0].headline())
    return enforce(stream_bounds(points), args.bound_tolerance, out)
