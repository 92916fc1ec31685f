#!/usr/bin/env python3
"""What recreating the engine's context in the other KV layout costs on the GPU (issue 24).

Under ``kv_layout="auto"`` the engine closes its context and makes one of the other layout
when a burst needs it (a shared document longer than a slot's stream: one pool; private
histories after that: a stream a slot). Why: the peer's fanout and swarm, which need such a
switch, spent far longer outside any engine step than private, which needs none, and a fresh
server's first step was slower than the same shape after it (figures: ``bench/RESULTS.md``,
"H100, 2026-12-07 (third session)"). This probe times, with the peer's sizes (``--cells``
163,840 cells, ``--slots`` 32, n_batch 2,048, micro-batch 512, flash attention on):

- ``llama_free`` of a context of each layout, and ``llama_init_from_model`` of each, with
  llama.cpp's own log lines stamped with the time since the call began (which phase of the
  creation takes it);
- the first decodes after a creation (a 512-token prompt in one sequence, then one token in
  every slot), against the same decodes once more;
- a creation while the other layout's context still lives (both KV pools on the device at
  once, nothing freed first).

Usage: probe_relayout.py MODEL [--cells 163840] [--slots 32] [--rounds 3] [--out F]
"""

# ruff: noqa: I001  (kvrt first: it maps llama.cpp before NumPy is imported)
from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import kvrt  # noqa: F401  (loads llama.cpp first: see DEVELOPING.md)
from kvrt import Context, ContextParams, Model
from kvrt.engine.batch import Batch

T = TypeVar("T")


class StampedLines(logging.Handler):
    """llama.cpp's log lines (routed to ``kvrt.llama`` by kvrt's log hook), each with the milliseconds since
    :meth:`start`."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[float, str]] = []
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.lines, self.t0 = [], time.perf_counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(((time.perf_counter() - self.t0) * 1e3, record.getMessage()))


@contextmanager
def stamped(level: int) -> Iterator[StampedLines]:
    logger = logging.getLogger("kvrt.llama")
    handler, old_level = StampedLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def timed_ms(fn: Callable[[], T]) -> tuple[float, T]:
    """How long ``fn()`` took (milliseconds), and what it returned."""
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def decode_ms(ctx: Context, batch: Batch) -> float:
    """One decode of ``batch``, waited for: milliseconds."""
    t0 = time.perf_counter()
    ctx.decode(batch)
    ctx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def decodes(ctx: Context, batch: Batch, *, slots: int, prompt: int, vocab: int) -> dict[str, float]:
    """A ``prompt``-token prefill of sequence 0, then one token in every slot, each waited for (milliseconds);
    the cache is emptied after."""
    out = {}
    batch.clear()
    batch.add_sequence([(7 * i) % (vocab - 10) + 5 for i in range(prompt)], 0, 0, logits_last=True)
    out["prompt_ms"] = decode_ms(ctx, batch)
    batch.clear()
    for slot in range(slots):
        batch.add_sequence((5 + slot,), prompt if slot == 0 else 0, slot, logits_last=True)
    out["rows_ms"] = decode_ms(ctx, batch)
    ctx.clear()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--cells", type=int, default=163840)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--n-batch", type=int, default=2048)
    parser.add_argument("--ubatch", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=512, help="tokens of the first decode after a creation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    layouts = {
        "split": ContextParams(n_ctx=args.cells, n_batch=args.n_batch, n_ubatch=args.ubatch, n_seq_max=args.slots,
                               kv_unified=False, flash_attn="on"),
        "unified": ContextParams(n_ctx=args.cells, n_batch=args.n_batch, n_ubatch=args.ubatch,
                                 n_seq_max=args.slots, kv_unified=True, flash_attn="on"),
    }
    rows: list[dict[str, Any]] = []
    logs: dict[str, list[tuple[float, str]]] = {}
    with Model(args.model) as model, Batch(args.n_batch, n_seq_max=args.slots) as batch, \
            stamped(logging.INFO) as log:
        ctx = Context(model, layouts["split"])  # the engine's first context; its first decodes warm the process
        decodes(ctx, batch, slots=args.slots, prompt=args.prompt, vocab=model.n_vocab)
        current = "split"
        for rnd in range(1, args.rounds + 1):
            for target in ("unified", "split"):
                row: dict[str, Any] = {"round": rnd, "from": current, "to": target}
                row["free_ms"], _ = timed_ms(ctx.close)
                log.start()
                row["init_ms"], ctx = timed_ms(functools.partial(Context, model, layouts[target]))
                logs.setdefault(target, list(log.lines))
                row["first"] = decodes(ctx, batch, slots=args.slots, prompt=args.prompt, vocab=model.n_vocab)
                row["second"] = decodes(ctx, batch, slots=args.slots, prompt=args.prompt, vocab=model.n_vocab)
                rows.append(row)
                current = target
                print(f"round {rnd} {row['from']:>7} -> {target:<7} free {row['free_ms']:7.1f} ms, init "
                      f"{row['init_ms']:7.1f} ms; first prompt/rows {row['first']['prompt_ms']:6.1f} / "
                      f"{row['first']['rows_ms']:6.1f} ms, second {row['second']['prompt_ms']:6.1f} / "
                      f"{row['second']['rows_ms']:6.1f} ms", flush=True)
        other = "unified" if current == "split" else "split"
        both_ms, second_ctx = timed_ms(functools.partial(Context, model, layouts[other]))
        both_first = decodes(second_ctx, batch, slots=args.slots, prompt=args.prompt, vocab=model.n_vocab)
        print(f"{other} made while {current} lives: init {both_ms:7.1f} ms; first prompt/rows "
              f"{both_first['prompt_ms']:6.1f} / {both_first['rows_ms']:6.1f} ms", flush=True)
        second_ctx.close()
        ctx.close()
    for target, lines in logs.items():
        print(f"== llama.cpp's lines while making the {target} context (ms since the call began)")
        for ms, line in lines:
            print(f"  {ms:8.1f}  {line}")
    summary = {f"{k}_median_{t}": statistics.median(r[k] for r in rows if r["to"] == t)
               for k in ("free_ms", "init_ms") for t in layouts}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "args": vars(args), "rounds": rows, "both_alive_init_ms": both_ms,
                       "both_alive_first": both_first, "init_logs": logs, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
