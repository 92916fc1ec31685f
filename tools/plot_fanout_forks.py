#!/usr/bin/env python3
"""Shared mode's two forks side by side, from the summary.csv files of `kvrt bench fanout --fork ...`.

Left: the fork's host time per branch (both forks do the same seq_cp work). Right: what of it
lengthened the run (Fork_Exposed_Ms_Per_Branch). Usage:
    plot_fanout_forks.py OUT.png during/summary.csv after/summary.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS = (("Fork_Ms_Per_Branch", "fork host time per branch (ms)"),
          ("Fork_Exposed_Ms_Per_Branch", "fork time on the clock per branch (ms)"))


def main(out: str, *sweeps: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for path in sweeps:
        with Path(path).open() as f:
            rows = [r for r in csv.DictReader(f) if r["Arm"] == "shared" and int(r["N"]) > 1]
        for length in sorted({int(r["Doc_Tokens"]) for r in rows}):
            points = [r for r in rows if int(r["Doc_Tokens"]) == length]
            for ax, (column, label) in zip(axes, PANELS):
                ax.plot([int(r["N"]) for r in points], [float(r[column] or "nan") for r in points], marker="o",
                        label=f"{points[0]['Fork']}, {length} tokens")
                ax.set_xlabel("branches N")
                ax.set_title(label, fontsize=10)
    axes[0].set_ylabel("ms per branch")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
