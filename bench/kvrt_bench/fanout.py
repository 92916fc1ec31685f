"""Fan-out benchmark: N branches after one document, kvrt against a warm baseline, a real peer and the ideal.

Headline: the seed's (SwarmKV's) shape, a ``--doc-tokens`` (3501) token document made by
repeating "The quick brown fox jumps over the lazy dog." and two branches. Sweep: N
branches x document length. Every point runs its arms (``--headline-arms``,
``--sweep-arms``; see :mod:`kvrt_bench._fanout_arms` for what each puts on the
clock) side by side, ``--trials`` (>= 3) rounds, each round every arm once in a rotated
order, after one untimed warm-up round; nothing is scaled or reused between points.

Reported per point and arm: end-to-end and branch-2 activation, median [min-max];
the speed-up over the warm ``baseline`` and the fraction of the ``ideal`` (one prefill
plus one batched decode of all branches), each a per-round ratio summarised the same
way; against the naive (seed's) baseline and the peer too where they ran; and how many
branches' texts differ from the baseline's (the same greedy tokens are expected where
the arithmetic is the same; a batched decode may move logits by float noise).

Bounds, checked on every run after the data are written: no speed-up over the warm
baseline above N, no fraction of the ideal above 1 (``--bound-tolerance``); a figure
past its bound fails the run (exit code 3, the figure named on stderr).

Files under ``--out``/fanout: ``samples.csv`` (every arm of every round),
``summary.csv`` and ``fanout.json`` (per point and arm, with the machine and the
command), ``bounds.json``, ``plots/*.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvrt.bindings import FLASH_ATTN
from kvrt.branching.branches import FORKS, FanoutResult
from kvrt.engine.model import Model
from kvrt_bench import _fanout_arms
from kvrt_bench._bounds import DEFAULT_TOLERANCE, Bound, enforce, ideal_bound, speedup_bound
from kvrt_bench._fanout_arms import (
    ARMS,
    IDEAL_DECODES,
    PEER_ARMS,
    REFERENCE,
    RUNNERS,
    ArmRun,
    Setup,
    fox_document,
    make_setup,
    warm,
)
from kvrt_bench._plotting import draw
from kvrt_bench._stats import check_samples, machine, ratios, summarize, write_csv, write_json

__all__ = ["fox_document"]  # bench_snapshot uses it

HELP = "fan-out: kvrt vs a warm baseline, llama-cpp-python's prompt cache and the ideal; SwarmKV's table and a sweep"
IDEAL = ("one prefill + one decode of all branches from a free fork, measured in the same run (--ideal-decode best: "
         "the faster prefill and the faster decode of a batched and a one-sequence strategy)")
HEADLINE_ARMS = ",".join(ARMS)
SWEEP_ARMS = "baseline,peer-ram,isolated,shared,ideal"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF to benchmark (default: the demo model)")
    parser.add_argument("--doc-tokens", type=int, default=3501, help="headline document length in tokens")
    parser.add_argument("--max-tokens", type=int, default=6, help="tokens each branch generates")
    parser.add_argument("--trials", type=int, default=3, help="timed rounds per point (>= 3)")
    parser.add_argument("--headline-arms", default=HEADLINE_ARMS, help=f"comma-separated subset of {ARMS}")
    parser.add_argument("--sweep-n", default="1,2,8,32", help="comma-separated branch counts ('' skips the sweep)")
    parser.add_argument("--sweep-docs", default="512",
                        help="comma-separated document lengths; LENGTH:N/N/... gives that length its own branch counts")
    parser.add_argument("--peer-max-n", type=int, default=None,
                        help="sweep: run the peer arms only at points of at most this many branches (its per-branch "
                             "state saves dominate a long run; default: every point)")
    parser.add_argument("--sweep-arms", default=SWEEP_ARMS, help=f"comma-separated subset of {ARMS}")
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--flash-attn", choices=tuple(FLASH_ATTN), default="off",
                        help="every arm's contexts (off: exact tokens on the CPU, see kvrt demo --help)")
    parser.add_argument("--skip-headline", action="store_true")
    parser.add_argument("--fork", choices=FORKS, default=FORKS[0],
                        help="shared mode: seq_cp each prefill chunk to the branches as it is decoded, or the whole "
                             "document after the prefill")
    parser.add_argument("--ideal-decode", choices=IDEAL_DECODES, default="best",
                        help="the ideal: the faster prefill and decode of a batched strategy (shared context) and a "
                             "one-sequence one (branches one after another), or the batched one only (where batching "
                             "wins by far, as on a GPU)")
    parser.add_argument("--bound-tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="relative slack before a figure past its physical bound fails the run")


def _arms(spec: str) -> list[str]:
    """The arms named in ``spec``, the reference first; refuses unknown names and a missing reference."""
    arms = [a.strip() for a in spec.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or REFERENCE not in arms:
        raise SystemExit(f"arms {spec!r}: unknown {unknown}; the {REFERENCE!r} arm is required (ratios are to it)")
    return [REFERENCE] + [a for a in arms if a != REFERENCE]


def _mismatches(texts: list[str], reference: list[str]) -> int:
    """Branches whose text differs from the reference's. Bytes that are no valid UTF-8 are dropped from both
    first: kvrt decodes them as U+FFFD, llama-cpp-python drops them, from the same token ids."""
    def clean(text: str) -> str:
        return text.replace("\ufffd", "")

    return sum(clean(a) != clean(b) for a, b in zip(texts, reference)) + abs(len(texts) - len(reference))


def sweep_points(docs: str, default_ns: str) -> list[tuple[int, list[int]]]:
    """``--sweep-docs`` parsed: (length, branch counts) per length, ``LENGTH:N/N`` overriding ``--sweep-n``."""
    points = []
    for item in (x.strip() for x in docs.split(",") if x.strip()):
        length, _, ns = item.partition(":")
        counts = [int(n) for n in (ns.split("/") if ns else default_ns.split(",")) if n.strip()]
        if counts:
            points.append((int(length), counts))
    return points


def measure_point(setup: Setup, n: int, arms: list[str], trials: int, part: str) -> list[dict[str, Any]]:
    """``trials`` rounds of every arm at ``n`` branches, arms rotated per round; one row per arm and round."""
    rows = []
    for trial in range(trials):
        order = arms[trial % len(arms):] + arms[:trial % len(arms)]
        runs: dict[str, ArmRun] = {arm: RUNNERS[arm](setup, n) for arm in order}
        reference = runs[REFERENCE].texts
        for arm in arms:
            run = runs[arm]
            rows.append({"Part": part, "Doc_Tokens": len(setup.doc), "N": n, "Arm": arm, "Trial": trial + 1,
                         "Fork": setup.fork if arm == "shared" else "",
                         "E2E_Ms": run.total_ms, "Activation_Ms": run.activation_ms, "Prefill_Ms": run.prefill_ms,
                         "Fork_Ms": run.fork_ms, "Restore_Ms": run.restore_ms,
                         "Contexts_Created": run.contexts_created,
                         "Mismatched_Branches": _mismatches(run.texts, reference), "Texts": " | ".join(run.texts),
                         "_result": run.result})
        print(f"  round {trial + 1}/{trials}: " + ", ".join(f"{a} {runs[a].total_ms:.0f}" for a in arms) + " ms",
              file=sys.stderr)
    return rows


def _exposed_fork(run: FanoutResult, n: int, one_branch_prefill_ms: float | None) -> float | None:
    """Shared mode's fork time per branch that lengthened the run: all of it after the prefill; during the
    prefill, the prefill's growth over the same length's N=1 prefill (None without that N=1 prefill)."""
    if run.mode != "shared" or n < 2:
        return None
    if not run.fork_overlapped:
        return run.fork_ms / (n - 1)
    if one_branch_prefill_ms is None:
        return None
    return max(0.0, run.prefill_ms - one_branch_prefill_ms) / (n - 1)


def _ratio_columns(name: str, numerators: list[float], denominators: list[float]) -> dict[str, float]:
    s = ratios(numerators, denominators)
    return {name: s.median, f"{name}_Min": s.min, f"{name}_Max": s.max}


def _summary_columns(name: str, values: list[float]) -> dict[str, float]:
    s = summarize(values)
    return {name: s.median, f"{name}_Min": s.min, f"{name}_Max": s.max}


def summarize_point(rows: list[dict[str, Any]], one_branch_prefill_ms: float | None) -> list[dict[str, Any]]:
    """Per arm of one point: medians with min-max, per-round ratios to the baseline, naive, peer and ideal."""
    arms = list(dict.fromkeys(r["Arm"] for r in rows))
    e2e = {a: [r["E2E_Ms"] for r in rows if r["Arm"] == a] for a in arms}
    act = {a: [r["Activation_Ms"] for r in rows if r["Arm"] == a] for a in arms}
    first = rows[0]
    n = first["N"]
    out = []
    for arm in arms:
        mine = [r for r in rows if r["Arm"] == arm]
        row: dict[str, Any] = {"Part": first["Part"], "Doc_Tokens": first["Doc_Tokens"], "N": n, "Arm": arm,
                               "Fork": mine[0]["Fork"],
                               "Samples": len(mine), **_summary_columns("E2E_Ms", e2e[arm]),
                               **_summary_columns("Activation_Ms", act[arm])}
        row.update(_ratio_columns("Speedup_Vs_Baseline", e2e[REFERENCE], e2e[arm]))
        row.update(_ratio_columns("Activation_Speedup_Vs_Baseline", act[REFERENCE], act[arm]))
        for other, column in (("naive", "Speedup_Vs_Naive"), ("peer-ram", "Speedup_Vs_Peer_Ram"),
                              ("peer-disk", "Speedup_Vs_Peer_Disk")):
            if other in e2e:
                row.update(_ratio_columns(column, e2e[other], e2e[arm]))
        if "ideal" in e2e:
            row.update(_ratio_columns("Fraction_Of_Ideal", e2e["ideal"], e2e[arm]))
        row["Mismatched_Branches"] = sum(r["Mismatched_Branches"] for r in mine)
        row["Branches_Compared"] = n * len(mine)
        row["Prefill_Ms"] = summarize(r["Prefill_Ms"] for r in mine).median
        row["Restore_Ms"] = summarize(r["Restore_Ms"] for r in mine).median
        row["Fork_Ms_Per_Branch"] = summarize(r["Fork_Ms"] / max(n - 1, 1) for r in mine).median
        exposed = [_exposed_fork(r["_result"], n, one_branch_prefill_ms) for r in mine if r["_result"] is not None]
        row["Fork_Exposed_Ms_Per_Branch"] = (summarize(exposed).median
                                             if exposed and all(x is not None for x in exposed) else None)
        row["Contexts_Created"] = max(r["Contexts_Created"] for r in mine)
        out.append(row)
    return out


def point_bounds(summary: list[dict[str, Any]]) -> list[Bound]:
    """Every arm's speed-up over the warm baseline <= N, and every arm's fraction of the ideal <= 1."""
    bounds = []
    for row in summary:
        where = f"fanout {row['Doc_Tokens']} tokens x {row['N']} branches, {row['Arm']}"
        if row["Arm"] != REFERENCE:
            bounds.append(speedup_bound(f"{where}: e2e speed-up vs the warm baseline", row["Speedup_Vs_Baseline"],
                                        row["N"]))
        if row["Arm"] != "ideal" and "Fraction_Of_Ideal" in row:
            bounds.append(ideal_bound(f"{where}: fraction of the ideal", row["Fraction_Of_Ideal"], IDEAL))
    return bounds


def _print_point(summary: list[dict[str, Any]]) -> None:
    first = summary[0]
    print(f"\n{first['Doc_Tokens']}-token document, {first['N']} branches (median [min-max] of "
          f"{first['Samples']} rounds; ratios per round):")
    print("| arm | e2e ms | branch-2 activation ms | speed-up vs warm baseline | fraction of ideal | "
          "vs peer-ram | texts differing |")
    print("|---|---|---|---|---|---|---|")
    for r in summary:
        ideal = f"{r['Fraction_Of_Ideal']:.3f}" if "Fraction_Of_Ideal" in r else "-"
        peer = f"{r['Speedup_Vs_Peer_Ram']:.2f}x" if "Speedup_Vs_Peer_Ram" in r else "-"
        print(f"| {r['Arm']} | {r['E2E_Ms']:.1f} [{r['E2E_Ms_Min']:.1f}-{r['E2E_Ms_Max']:.1f}] | "
              f"{r['Activation_Ms']:.1f} [{r['Activation_Ms_Min']:.1f}-{r['Activation_Ms_Max']:.1f}] | "
              f"{r['Speedup_Vs_Baseline']:.2f}x [{r['Speedup_Vs_Baseline_Min']:.2f}-"
              f"{r['Speedup_Vs_Baseline_Max']:.2f}] | {ideal} | {peer} | "
              f"{r['Mismatched_Branches']}/{r['Branches_Compared']} |", flush=True)


class Recorder:
    """Collects rows and summaries and rewrites the result files after every point (a cut-short run keeps them)."""

    def __init__(self, out: Path, model: Model, args: argparse.Namespace) -> None:
        self.out = out
        self.samples: list[dict[str, Any]] = []
        self.summary: list[dict[str, Any]] = []
        self.meta = {"machine": machine(), "model": model.path.name, "model_desc": model.description,
                     "args": {k: v for k, v in vars(args).items() if not callable(v)}, "ideal": IDEAL,
                     "arms": _fanout_arms.__doc__}

    def add(self, rows: list[dict[str, Any]], summary: list[dict[str, Any]]) -> None:
        self.samples += [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        self.summary += summary
        write_csv(self.out / "samples.csv", self.samples)
        write_csv(self.out / "summary.csv", self.summary)
        write_json(self.out / "fanout.json", {**self.meta, "summary": self.summary})


def run_length(model: Model, args: argparse.Namespace, doc_tokens: int, ns: list[int], arms: list[str], part: str,
               recorder: Recorder) -> None:
    """Every point of one document length, on one setup (pools, peer) warmed once."""
    setup = make_setup(model, doc_tokens, max(ns), arms, args)
    try:
        print(f"{part}: {doc_tokens}-token document, warm-up (untimed): every arm once at N={min(2, max(ns))}",
              file=sys.stderr)
        warm(setup, arms, min(2, max(ns)))
        one_prefill: float | None = None
        for n in ns:
            here = [a for a in arms if a not in PEER_ARMS or args.peer_max_n is None or n <= args.peer_max_n]
            print(f"{part}: {doc_tokens} tokens x {n} branches, arms {', '.join(here)}", file=sys.stderr)
            rows = measure_point(setup, n, here, args.trials, part)
            if n == 1 and "shared" in arms:
                one_prefill = summarize(r["Prefill_Ms"] for r in rows if r["Arm"] == "shared").median
            summary = summarize_point(rows, one_prefill)
            recorder.add(rows, summary)
            _print_point(summary)
    finally:
        setup.close()


def run(args: argparse.Namespace) -> int:
    from kvrt.modelfiles.demo_model import demo_model_path

    check_samples(args.trials)
    out = Path(args.out) / "fanout"
    out.mkdir(parents=True, exist_ok=True)
    with Model(args.model or demo_model_path(), n_gpu_layers=args.n_gpu_layers) as model:
        print(f"model: {model.description} ({model.path.name})", file=sys.stderr)
        recorder = Recorder(out, model, args)
        if not args.skip_headline:
            run_length(model, args, args.doc_tokens, [2], _arms(args.headline_arms), "headline", recorder)
        for length, ns in sweep_points(args.sweep_docs, args.sweep_n):
            run_length(model, args, length, ns, _arms(args.sweep_arms), "sweep", recorder)
    draw(_plot, recorder.summary, out / "plots")
    print(f"results in {out}")
    return enforce(point_bounds(recorder.summary), args.bound_tolerance, out)


def _plot(summary: list[dict[str, Any]], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    head = [r for r in summary if r["Part"] == "headline"]
    if head:
        fig, ax = plt.subplots(figsize=(8, 3.8))
        values = [r["E2E_Ms"] for r in head]
        errors = [[r["E2E_Ms"] - r["E2E_Ms_Min"] for r in head], [r["E2E_Ms_Max"] - r["E2E_Ms"] for r in head]]
        ax.bar([r["Arm"] for r in head], values, yerr=errors, capsize=3, color="#1f77b4")
        ax.set_ylabel("end-to-end ms (median, min-max)")
        ax.set_title(f"{head[0]['Doc_Tokens']}-token document, {head[0]['N']} branches")
        ax.tick_params(axis="x", labelrotation=30)
        fig.tight_layout()
        fig.savefig(folder / "headline_e2e.png", dpi=120)
        plt.close(fig)
    sweep = [r for r in summary if r["Part"] == "sweep"]
    for column, label, name in (("Speedup_Vs_Baseline", "speed-up vs the warm baseline", "sweep_speedup.png"),
                                ("Fraction_Of_Ideal", "fraction of the ideal", "sweep_fraction_of_ideal.png")):
        if not sweep or column not in sweep[0]:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for arm in dict.fromkeys(r["Arm"] for r in sweep):
            for length in sorted({r["Doc_Tokens"] for r in sweep}):
                pts = [r for r in sweep if r["Arm"] == arm and r["Doc_Tokens"] == length and column in r]
                if pts and arm != REFERENCE:
                    ax.errorbar([r["N"] for r in pts], [r[column] for r in pts],
                                yerr=[[r[column] - r[f"{column}_Min"] for r in pts],
                                      [r[f"{column}_Max"] - r[column] for r in pts]],
                                marker="o", capsize=2, label=f"{arm}, {length} tok")
        ns = sorted({r["N"] for r in sweep})
        if column == "Speedup_Vs_Baseline":
            ax.plot(ns, ns, "k--", lw=0.8, label="bound N")
        else:
            ax.axhline(1.0, color="k", ls="--", lw=0.8, label="ideal")
        ax.set_xlabel("branches N")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=120)
        plt.close(fig)
