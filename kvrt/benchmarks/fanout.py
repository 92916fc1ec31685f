"""Fan-out benchmark: the SwarmKV table (seed 000) side by side with its baseline, then an N x length sweep.

Headline: a document of ``--doc-tokens`` (3501) tokens made by repeating "The quick
brown fox jumps over the lazy dog.", two branches. What is on the clock:

- baseline (the seed's, unchanged): for each branch, create a fresh context, prefill the
  whole document, decode the branch, free the context;
- kvrt: one prefill into a context that already exists, then the branches - ``isolated``
  (capture a snapshot into the host pool; the first branch continues in the prefill
  context, the second restores the snapshot into a pooled context) and ``shared``
  (``seq_cp`` in one pooled unified-KV context, during the prefill or after it as
  ``--fork`` says, one batch per step). Each mode's context
  pool and the pinned snapshot buffer are created before the trials by one untimed
  warm-up run per mode (a serving process keeps them); ``Kvrt_Contexts_Created`` counts
  contexts created inside a timed run (0 when the pools did their job).

Metrics per
trial: End_To_End_Ms, Branch2_Activation_Ms (branch-specific work after the shared
prefill: baseline = fresh context + redundant prefill + prompt + first token; kvrt =
lease/fork + restore + prompt + first token; Kvrt_Branch2_Restore_Ms is the lease +
restore part alone), Redundant_Prefill_Eliminated_Ms and the ratios. The best of
``--trials`` by 2*TTFT_pct + E2E_pct goes to best_run.json; every trial to
all_trials.csv; plots to plots/*.png.

Sweep: N branches x document length, both modes, each mode on its own pool warmed per
length (untimed). The baseline is NOT run per point: ``--baseline-branches`` fresh-context
branches are measured once per length and their mean is multiplied by N (CSV columns
``Baseline_Per_Branch_Ms``, ``Baseline_Measured_Branches``), because 50 full prefills of
32k tokens alone exceed the time budget. ``Mean_Activation_Ms``/``Mean_Restore_Ms`` average
branches 2..N (branch 1 alone when N=1): in isolated mode those are the branches that restore.
Shared mode's fork: ``Fork_Ms_Per_Branch`` is its host time per branch, and
``Fork_Exposed_Ms_Per_Branch`` what of it the clock saw: all of it after the prefill, and
during the prefill the prefill's growth over the same length's N=1 prefill (0 when the
bookkeeping hid under the GPU's compute; empty without an N=1 point).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvrt.benchmarks._plotting import draw
from kvrt.branches import FORKS, Branch, FanoutResult, branch_budget, fanout, isolated_params, shared_params
from kvrt.context import Context, ContextParams
from kvrt.contextpool import ContextPool
from kvrt.generation import GenerationParams, generate, prefill
from kvrt.model import Model

HELP = "SwarmKV's two-branch table (baseline vs isolated vs shared) and the N x document sweep"
SENTENCE = "The quick brown fox jumps over the lazy dog. "
QUESTIONS = (" Question: which animal jumps? Answer:", " Question: what is the dog like? Answer:")
MODES = ("isolated", "shared")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF to benchmark (default: the demo model)")
    parser.add_argument("--doc-tokens", type=int, default=3501, help="headline document length in tokens")
    parser.add_argument("--max-tokens", type=int, default=6, help="tokens each branch generates")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--sweep-n", default="1,2,8,32,50", help="comma-separated branch counts ('' skips)")
    parser.add_argument("--sweep-docs", default="512,3501,32000", help="comma-separated document lengths")
    parser.add_argument("--sweep-modes", default="isolated,shared")
    parser.add_argument("--baseline-branches", type=int, default=2,
                        help="fresh-context branches actually measured per sweep point (scaled to N)")
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--skip-headline", action="store_true")
    parser.add_argument("--fork", choices=FORKS, default=FORKS[0],
                        help="shared mode: seq_cp each prefill chunk to the branches as it is decoded, or the whole "
                             "document after the prefill")


def fox_document(model: Model, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` token ids: BOS (if the model adds one) + the fox sentence repeated."""
    sentence = model.tokenize(SENTENCE, add_special=False)
    head = model.tokenize("", add_special=True)
    repeats = -(-max(n_tokens - len(head), 1) // len(sentence))
    return (head + sentence * repeats)[:n_tokens]


def _progress(label: str):
    def report(done: int, total: int) -> None:
        print(f"\r  {label}: prefill {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr,
              flush=True)
    return report


@dataclass
class Baseline:
    end_to_end_ms: float
    branch_ms: list[float]  # fresh context + prefill + branch, per branch
    prefill_ms: list[float]
    activation_ms: list[float]  # fresh context + prefill + prompt + first token
    texts: list[str]


def run_baseline(model: Model, doc: list[int], branches: list[Branch], params: ContextParams) -> Baseline:
    """SwarmKV's baseline: each branch in a fresh context that prefills the whole document."""
    t0 = time.perf_counter()
    branch_ms, prefill_ms, activation_ms, texts = [], [], [], []
    for branch in branches:
        t_branch = time.perf_counter()
        with Context(model, params) as ctx:
            t_pre = time.perf_counter()
            prefill(ctx, doc, logits_last=False)
            t_doc = time.perf_counter()
            done = generate(ctx, model.tokenize(branch.prompt, add_special=False), branch.params)
        end = time.perf_counter()
        prefill_ms.append((t_doc - t_pre) * 1e3)
        activation_ms.append((t_doc - t_branch) * 1e3 + done.timings_ms["first_token_ms"])
        branch_ms.append((end - t_branch) * 1e3)
        texts.append(done.text)
    return Baseline((time.perf_counter() - t0) * 1e3, branch_ms, prefill_ms, activation_ms, texts)


def _pct(baseline: float, kvrt: float) -> float:
    return (1.0 - kvrt / baseline) * 100.0 if baseline > 0 else 0.0


def headline_row(trial: int, base: Baseline, run: FanoutResult) -> dict[str, Any]:
    b2 = run.branches[1]
    row = {
        "Trial": trial, "Mode": run.mode, "Exact": run.exact, "Doc_Tokens": run.doc_tokens,
        "Baseline_End_To_End_Ms": base.end_to_end_ms, "Kvrt_End_To_End_Ms": run.total_ms,
        "Baseline_Branch2_Activation_Ms": base.activation_ms[1], "Kvrt_Branch2_Activation_Ms": b2.activation_ms,
        "Kvrt_Branch2_Restore_Ms": b2.restore_ms, "Kvrt_Prefill_Ms": run.prefill_ms, "Kvrt_Fork_Ms": run.fork_ms,
        "Redundant_Prefill_Eliminated_Ms": sum(base.prefill_ms[1:]),
        "Kvrt_Contexts_Created": run.contexts_created,
    }
    row["E2E_Pct"] = _pct(row["Baseline_End_To_End_Ms"], row["Kvrt_End_To_End_Ms"])
    row["TTFT_Pct"] = _pct(row["Baseline_Branch2_Activation_Ms"], row["Kvrt_Branch2_Activation_Ms"])
    row["E2E_Speedup"] = row["Baseline_End_To_End_Ms"] / row["Kvrt_End_To_End_Ms"]
    row["Branch2_Activation_Speedup"] = row["Baseline_Branch2_Activation_Ms"] / row["Kvrt_Branch2_Activation_Ms"]
    row["Score"] = 2 * row["TTFT_Pct"] + row["E2E_Pct"]
    row["Texts_Match_Baseline"] = [b.text for b in run.branches] == base.texts
    return row


ON_THE_CLOCK = ("on the clock - baseline (the seed's): per branch a fresh context is created, prefills the whole "
                "document, decodes the branch and is freed. kvrt: one prefill into an already-created pooled "
                "context, then capture+restore (isolated) or seq_cp during or after the prefill (shared, as --fork "
                "says) and the branches; the pools' contexts "
                "and the host-pool snapshot buffer (pinned on a GPU machine) were made by an untimed warm-up run per "
                "mode")


def _pools(model: Model, doc_tokens: int, branches: list[Branch], args: argparse.Namespace,
           n_seq: int) -> dict[str, ContextPool]:
    """One pool per mode, shaped as fanout would shape its own contexts; ``n_seq`` branches at most."""
    needs = [branch_budget(model, b)[1] for b in branches]
    return {
        "isolated": ContextPool(model, isolated_params(doc_tokens + max(needs), n_batch=args.n_batch,
                                                       n_threads=args.threads), max_idle=1),
        "shared": ContextPool(model, shared_params(doc_tokens + max(needs) * n_seq, n_seq, n_batch=args.n_batch,
                                                   n_threads=args.threads), max_idle=1),
    }


def _warm(model: Model, doc: list[int], branches: list[Branch], pools: dict[str, ContextPool], modes: list[str],
          run_modes: list[str], fork: str, max_ctx: int | None = None) -> None:
    """Untimed: create each pool's context, then one fan-out per mode in ``run_modes`` (isolated: pins the
    snapshot buffer of this document's size class; the first run of a process also loads the kernels)."""
    for mode in modes:
        pools[mode].warm(1)
    for mode in run_modes:
        fanout(model, doc, branches, mode=mode, pool=pools[mode], max_ctx=max_ctx, fork=fork)


def headline(model: Model, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    doc = fox_document(model, args.doc_tokens)
    branches = [Branch(q, GenerationParams(max_tokens=args.max_tokens), f"agent{i + 1}")
                for i, q in enumerate(QUESTIONS)]
    need = len(doc) + max(len(model.tokenize(b.prompt, add_special=False)) for b in branches) + args.max_tokens
    params = ContextParams(n_ctx=-(-need // 256) * 256, n_batch=args.n_batch, n_ubatch=min(args.n_batch, 512),
                           n_threads=args.threads)  # the baseline's fresh contexts (unchanged)
    rows: list[dict[str, Any]] = []
    pools = _pools(model, len(doc), branches, args, len(branches))
    print(ON_THE_CLOCK, file=sys.stderr)
    try:
        print("headline: warm-up, one untimed run per mode", file=sys.stderr)
        _warm(model, doc, branches, pools, list(MODES), list(MODES), args.fork)
        for trial in range(1, args.trials + 1):
            print(f"headline trial {trial}/{args.trials} ({len(doc)}-token document)", file=sys.stderr)
            base = run_baseline(model, doc, branches, params)
            for mode in MODES:
                run = fanout(model, doc, branches, mode=mode, pool=pools[mode], fork=args.fork)
                rows.append(headline_row(trial, base, run))
                r = rows[-1]
                print(f"  {mode:8s} e2e {r['Kvrt_End_To_End_Ms']:.0f} ms vs {r['Baseline_End_To_End_Ms']:.0f} ms "
                      f"({r['E2E_Speedup']:.2f}x); branch-2 activation {r['Kvrt_Branch2_Activation_Ms']:.1f} ms vs "
                      f"{r['Baseline_Branch2_Activation_Ms']:.0f} ms ({r['Branch2_Activation_Speedup']:.1f}x); "
                      f"contexts created on the clock: kvrt {run.contexts_created}, baseline {len(branches)}",
                      file=sys.stderr)
    finally:
        for pool in pools.values():
            pool.close()
    _write_csv(out / "all_trials.csv", rows)
    best = {mode: max((r for r in rows if r["Mode"] == mode), key=lambda r: r["Score"]) for mode in MODES}
    (out / "best_run.json").write_text(json.dumps({"machine": _machine(model), "selection": "2*TTFT_Pct + E2E_Pct",
                                                   "on_the_clock": ON_THE_CLOCK, "best": best}, indent=2,
                                                  default=str))
    draw(_plot_headline, best, out / "plots")
    return rows


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} ms"


def _exposed_fork(run: FanoutResult, n: int, one_branch_prefill_ms: float | None) -> float | None:
    """Shared mode's fork time per branch that lengthened the run (see the module docstring)."""
    if run.mode != "shared" or n < 2:
        return None
    if not run.fork_overlapped:
        return run.fork_ms / (n - 1)
    if one_branch_prefill_ms is None:
        return None
    return max(0.0, run.prefill_ms - one_branch_prefill_ms) / (n - 1)


def sweep(model: Model, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    ns = [int(x) for x in args.sweep_n.split(",") if x.strip()]
    lengths = [int(x) for x in args.sweep_docs.split(",") if x.strip()]
    modes = [m for m in args.sweep_modes.split(",") if m.strip()]
    rows: list[dict[str, Any]] = []
    for length in lengths:
        doc = fox_document(model, length)
        params = ContextParams(n_ctx=-(-(length + 64 + args.max_tokens) // 256) * 256, n_batch=args.n_batch,
                               n_ubatch=min(args.n_batch, 512), n_threads=args.threads)
        one = [Branch(QUESTIONS[i % 2], GenerationParams(max_tokens=args.max_tokens)) for i in range(max(ns))]
        measured = min(args.baseline_branches, max(ns))
        print(f"sweep: baseline for {length} tokens = {measured} fresh-context branch(es) measured (create, prefill "
              f"{length} tokens, decode), mean x N; not re-run per point", file=sys.stderr)
        base = run_baseline(model, doc, one[:measured], params)
        per_branch = sum(base.branch_ms) / measured
        print(f"  baseline per branch {per_branch:.0f} ms", file=sys.stderr)
        pools = _pools(model, length, one, args, max(ns))
        max_ctx = pools["shared"].params.n_ctx
        one_branch_prefill: dict[str, float] = {}
        try:
            warm_runs = [m for m in modes if m == "isolated"]  # shared needs only its context: no host buffer
            print(f"sweep: warm-up for {length} tokens (untimed): pooled contexts for {', '.join(modes)}; one "
                  f"2-branch run for {', '.join(warm_runs) or 'no mode'}", file=sys.stderr)
            _warm(model, doc, one[:2], pools, modes, warm_runs, args.fork, max_ctx)
            for n in ns:
                for mode in modes:
                    print(f"sweep: N={n} doc={length} {mode}", file=sys.stderr)
                    run = fanout(model, doc, one[:n], mode=mode, pool=pools[mode], max_ctx=max_ctx,
                                 progress=_progress(f"N={n} {mode}"), fork=args.fork)
                    baseline_ms = per_branch * n
                    later = run.branches[1:] or run.branches
                    if n == 1:
                        one_branch_prefill[mode] = run.prefill_ms
                    rows.append({
                        "N": n, "Doc_Tokens": length, "Mode": run.mode,
                        "Fork": args.fork if run.mode == "shared" else "snapshot", "Kvrt_End_To_End_Ms": run.total_ms,
                        "Kvrt_Prefill_Ms": run.prefill_ms, "Kvrt_Fork_Ms": run.fork_ms,
                        "Fork_Ms_Per_Branch": run.fork_ms / max(n - 1, 1) if run.mode == "shared" else run.fork_ms,
                        "Fork_Exposed_Ms_Per_Branch": _exposed_fork(run, n, one_branch_prefill.get(mode)),
                        "Mean_Activation_Ms": sum(b.activation_ms for b in later) / len(later),
                        "Mean_Restore_Ms": sum(b.restore_ms for b in later) / len(later),
                        "Kvrt_Contexts_Created": run.contexts_created,
                        "Baseline_End_To_End_Ms": baseline_ms, "Baseline_Per_Branch_Ms": per_branch,
                        "Baseline_Measured_Branches": measured, "E2E_Speedup": baseline_ms / run.total_ms,
                    })
                    r = rows[-1]
                    print(f"  e2e {r['Kvrt_End_To_End_Ms']:.0f} ms vs baseline {baseline_ms:.0f} ms (= {n} x "
                          f"{per_branch:.0f} ms measured once) ({r['E2E_Speedup']:.1f}x), fork/branch "
                          f"{r['Fork_Ms_Per_Branch']:.3f} ms ({_ms(r['Fork_Exposed_Ms_Per_Branch'])} on the clock), "
                          f"activation (branches 2..N) {r['Mean_Activation_Ms']:.1f} ms, restore "
                          f"{r['Mean_Restore_Ms']:.1f} ms, contexts created {run.contexts_created}",
                          file=sys.stderr)
                    _write_csv(out / "sweep.csv", rows)  # after every point: a run cut short keeps what it measured
        finally:
            for pool in pools.values():
                pool.close()
    draw(_plot_sweep, rows, out / "plots")
    return rows


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _machine(model: Model) -> dict[str, Any]:
    return {"python": platform.python_version(), "machine": platform.machine(), "node": platform.node(),
            "model": model.path.name, "model_desc": model.description,
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


def _plot_headline(best: dict[str, dict[str, Any]], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    any_row = next(iter(best.values()))
    labels = ["baseline"] + list(best)
    for metric, title in (("End_To_End_Ms", "End-to-end"), ("Branch2_Activation_Ms", "Branch-2 activation")):
        values = [any_row[f"Baseline_{metric}"]] + [best[m][f"Kvrt_{metric}"] for m in best]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(labels, values, color=["#999999", "#1f77b4", "#2ca02c"][:len(values)])
        ax.set_ylabel("ms")
        ax.set_title(f"{title}, {any_row['Doc_Tokens']}-token document, 2 branches")
        for i, v in enumerate(values):
            ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom")
        fig.tight_layout()
        fig.savefig(folder / f"{metric.lower()}.png", dpi=120)
        plt.close(fig)


def _plot_sweep(rows: list[dict[str, Any]], folder: Path) -> None:
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    for metric, ylabel, name in (("E2E_Speedup", "speed-up vs N fresh prefills", "sweep_speedup.png"),
                                 ("Fork_Ms_Per_Branch", "fork / snapshot ms per branch", "sweep_fork_ms.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in sorted({r["Mode"] for r in rows}):
            for length in sorted({r["Doc_Tokens"] for r in rows}):
                pts = [(r["N"], r[metric]) for r in rows if r["Mode"] == mode and r["Doc_Tokens"] == length]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{mode}, {length} tok")
        ax.set_xlabel("branches N")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=120)
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from kvrt.demo_model import demo_model_path

    out = Path(args.out) / "fanout"
    out.mkdir(parents=True, exist_ok=True)
    with Model(args.model or demo_model_path(), n_gpu_layers=args.n_gpu_layers) as model:
        print(f"model: {model.description} ({model.path.name})", file=sys.stderr)
        if not args.skip_headline:
            rows = headline(model, args, out)
            print(format_table(rows))
        if args.sweep_n.strip() and args.sweep_docs.strip():
            sweep(model, args, out)
    print(f"results in {out}")
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    """The best trial of each mode as the seed's side-by-side table."""
    best = {m: max((r for r in rows if r["Mode"] == m), key=lambda r: r["Score"]) for m in {r["Mode"] for r in rows}}
    first = next(iter(best.values()))
    lines = [f"| metric | baseline | {' | '.join(best)} |", "|---|---|" + "---|" * len(best)]
    for label, key in (("End_To_End_Ms", "End_To_End_Ms"), ("Branch2_Activation_Ms", "Branch2_Activation_Ms")):
        lines.append(f"| {label} | {first[f'Baseline_{key}']:.1f} | "
                     + " | ".join(f"{best[m][f'Kvrt_{key}']:.1f}" for m in best) + " |")
    for label in ("Kvrt_Branch2_Restore_Ms", "Kvrt_Prefill_Ms", "Redundant_Prefill_Eliminated_Ms", "E2E_Pct",
                  "TTFT_Pct", "E2E_Speedup", "Branch2_Activation_Speedup", "Kvrt_Contexts_Created"):
        lines.append(f"| {label} | | " + " | ".join(f"{best[m][label]:.2f}" for m in best) + " |")
    return "\n".join(lines)
