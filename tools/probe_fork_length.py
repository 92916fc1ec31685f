#!/usr/bin/env python3
"""How a fork's cost follows the document length (issue 15: a fork at 3.5k, 32k and 128k tokens).

A shared-mode fork is ``llama_memory_seq_cp(0, b)``: no KV bytes move, but llama.cpp
visits every cell of the source and records the new sequence in each (a bit in the cell
and one ``std::map`` update for the sequence's positions). This probe prefills one
document per length into a unified context with ``--branches`` extra sequences and times,
median of ``--reps``:

- ``fork_ms``: ``seq_cp`` of the whole document into one branch;
- ``fork_all_ms_per_branch``: ``seq_cp`` into every branch, one after the other, per branch;
- ``drop_ms``: ``seq_rm`` of one branch (what ends a branch);

each also per cell of the document, so a length-independent fork would show a falling
``ns_per_cell``. Usage: probe_fork_length.py MODEL [--docs 3501,32000,131072] [--branches 8]
"""

# ruff: noqa: I001  (kvrt first: it maps llama.cpp before NumPy is imported)
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import kvrt  # noqa: F401  (loads llama.cpp first: see DEVELOPING.md)
from kvrt import Context, ContextParams, Model
from kvrt.engine.generation import prefill


def timed(reps: int, action: Callable[[], None], undo: Callable[[], None]) -> float:
    """Median milliseconds of ``action`` over ``reps`` runs, ``undo`` (untimed) after each."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        action()
        times.append((time.perf_counter() - t0) * 1e3)
        undo()
    return statistics.median(times)


def measure(model: Model, n_doc: int, branches: int, reps: int, flash_attn: str) -> dict[str, float]:
    """Prefill ``n_doc`` tokens into sequence 0, then time the forks and drops of the module docstring."""
    params = ContextParams(n_ctx=n_doc + 256, n_batch=2048, n_ubatch=512, n_seq_max=branches + 1, kv_unified=True,
                           flash_attn=flash_attn)
    vocab = model.n_vocab
    with Context(model, params) as ctx:
        t0 = time.perf_counter()
        prefill(ctx, [(7 * i) % (vocab - 10) + 5 for i in range(n_doc)], logits_last=False)
        ctx.synchronize()
        prefill_ms = (time.perf_counter() - t0) * 1e3

        def drop_all() -> None:
            for b in range(1, branches + 1):
                ctx.seq_rm(b)

        def fork_all() -> None:
            for b in range(1, branches + 1):
                ctx.seq_cp(0, b)

        fork_ms = timed(reps, lambda: ctx.seq_cp(0, 1), lambda: ctx.seq_rm(1))
        fork_all_ms = timed(reps, fork_all, drop_all)
        drop_ms = timed(reps, lambda: ctx.seq_rm(1), lambda: ctx.seq_cp(0, 1))
        assert ctx.seq_len(1) == n_doc, "the last undo left branch 1 forked"
        ctx.seq_rm(1)
    per_branch = fork_all_ms / branches
    return {"doc_tokens": n_doc, "branches": branches, "prefill_ms": prefill_ms, "fork_ms": fork_ms,
            "fork_ns_per_cell": fork_ms * 1e6 / n_doc, "fork_all_ms_per_branch": per_branch,
            "fork_all_ns_per_cell": per_branch * 1e6 / n_doc, "drop_ms": drop_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--docs", default="3501,32000,131072", help="document lengths in tokens, comma-separated")
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--flash-attn", default="on", choices=("on", "off", "auto"))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    rows = []
    with Model(args.model) as model:
        for n_doc in (int(d) for d in args.docs.split(",")):
            row = measure(model, n_doc, args.branches, args.reps, args.flash_attn)
            rows.append(row)
            print(f"doc {n_doc:>7}: prefill {row['prefill_ms']:9.1f} ms | fork {row['fork_ms']:7.3f} ms "
                  f"({row['fork_ns_per_cell']:5.1f} ns/cell) | fork x{args.branches} "
                  f"{row['fork_all_ms_per_branch']:7.3f} ms/branch ({row['fork_all_ns_per_cell']:5.1f} ns/cell) "
                  f"| drop {row['drop_ms']:7.3f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "reps": args.reps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
