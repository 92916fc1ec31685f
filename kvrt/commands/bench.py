"""Run one of kvrt's benchmark harnesses (results as JSON/CSV/PNG under --out)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import kvrt_bench

HELP = "run a benchmark harness: " + ", ".join(
    m.name.replace("_", "-") for m in pkgutil.iter_modules(kvrt_bench.__path__) if not m.name.startswith("_")
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for info in sorted(pkgutil.iter_modules(kvrt_bench.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"kvrt_bench.{info.name}")
        command = sub.add_parser(info.name.replace("_", "-"), help=module.HELP, description=module.__doc__)
        command.add_argument("--out", default="bench/results", help="directory for JSON/CSV/PNG results")
        module.add_arguments(command)
        command.set_defaults(bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_run(args) or 0)
