#!/usr/bin/env python3
"""Which batch shape prefills many private prompts fastest in per-slot KV streams (issue 24).

On the H200, kvrt's N = 32 private first turn ran its 2,048-token prompt steps at 80-93 ms
(median 87.9) where ``llama-batched-bench`` on the same build prefills 32 x 4,096 tokens at
80.3 ms per 2,048. The two differ in two ways this probe separates:

- **The micro-batch's shape.** kvrt lays a step out as prompt chunks of consecutive slots
  (e.g. 4 x 512 for slots 16-19); with a stream per slot llama.cpp's ``split_equal`` then
  makes each 512-token micro-batch of all four sequences, 128 tokens each. batched-bench
  decodes one sequence at a time: 512 tokens of one stream a micro-batch. The same chunks in
  descending slot order get batched-bench's shape (``split_equal`` takes only increasing
  sequence ids, so each micro-batch holds one sequence).
- **The wait after each step.** kvrt synchronizes after every step; batched-bench queues its
  whole prompt and waits once, so the host's work between steps runs under the GPU's.

Every variant prefills ``--slots`` prompts of ``--prompt`` tokens in steps of ``--chunks``
chunks of ``--chunk`` tokens (slots taken in turn, as kvrt's round robin does), from an
empty cache each time, and reports milliseconds a step (median, and the mean over the
whole prefill); then decode steps of one token in every slot (:func:`decode_steps`).
Usage: probe_prefill_shapes.py MODEL [--slots 32] [--prompt 4096] [--out F]
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
from kvrt.engine.batch import Batch

Order = Callable[[list[int]], list[int]]
VARIANTS: dict[str, tuple[Order, bool, bool]] = {
    # name: (slot order within a step, wait after every step, one llama_decode a chunk)
    "consecutive, wait each step (kvrt)": (sorted, True, False),
    "consecutive, no wait": (sorted, False, False),
    "descending, wait each step": (lambda slots: sorted(slots, reverse=True), True, False),
    "descending, no wait": (lambda slots: sorted(slots, reverse=True), False, False),
    "a decode a chunk, no wait": (sorted, False, True),
}


def prefill_steps(ctx: Context, batch: Batch, *, slots: int, prompt: int, chunk: int, chunks: int,
                  order: Order, wait: bool, per_chunk: bool, vocab: int) -> list[float]:
    """Prefill every slot's prompt in steps of ``chunks`` chunks; the milliseconds each step took to return
    (to finish, where ``wait``; the last step waits either way so the total is the GPU's)."""
    ctx.clear()
    work = [(slot, p0) for p0 in range(0, prompt, chunk) for slot in range(slots)]  # round robin over slots
    steps = [work[i:i + chunks] for i in range(0, len(work), chunks)]
    times = []
    for n, step in enumerate(steps):
        t0 = time.perf_counter()
        p0_of = dict(step)
        groups = [[slot] for slot in order(list(p0_of))] if per_chunk else [order(list(p0_of))]
        for group in groups:
            batch.clear()
            for slot in group:
                p0 = p0_of[slot]
                tokens = [(31 * (slot * prompt + p0 + i)) % (vocab - 10) + 5 for i in range(min(chunk, prompt - p0))]
                batch.add_sequence(tokens, p0, slot, logits_last=p0 + chunk >= prompt)
            ctx.decode(batch)
        if wait or n == len(steps) - 1:
            ctx.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def decode_steps(ctx: Context, batch: Batch, *, slots: int, prompt: int, steps: int) -> dict[str, float]:
    """``steps`` decode steps of one token in every slot after its ``prompt`` tokens, each waited for, then the
    same with the rows' greedy picks read back (what an engine's step needs before the next): milliseconds a step,
    medians, to compare with ``llama-batched-bench``'s generation of the same slots."""
    out = {}
    for name, pick in (("decode_ms", False), ("decode_argmax_ms", True)):
        times = []
        for i in range(steps):
            batch.clear()
            rows = [batch.add_sequence((5 + slot,), prompt + i, slot) for slot in range(slots)]
            t0 = time.perf_counter()
            ctx.decode(batch)
            ctx.synchronize()
            if pick:
                ctx.argmax(rows)
            times.append((time.perf_counter() - t0) * 1e3)
        for slot in range(slots):
            ctx.seq_rm(slot, prompt)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=4096, help="tokens a slot")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=4, help="chunks a step (n_batch = chunks x chunk)")
    parser.add_argument("--ubatch", type=int, default=512, help="llama.cpp's micro-batch")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp's CPU threads (default: its own)")
    parser.add_argument("--cells", type=int, default=163840)
    parser.add_argument("--rounds", type=int, default=2, help="each variant this many times, interleaved")
    parser.add_argument("--flash-attn", default="on", choices=("on", "off", "auto"))
    parser.add_argument("--decode-steps", type=int, default=64, help="decode steps after the last prefill")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    params = ContextParams(n_ctx=args.cells, n_batch=args.chunk * args.chunks,
                           n_ubatch=min(args.ubatch, args.chunk * args.chunks), n_seq_max=args.slots, kv_unified=False,
                           flash_attn=args.flash_attn, **({"n_threads": args.threads} if args.threads else {}))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    with Model(args.model) as model, Context(model, params) as ctx, \
            Batch(params.n_batch, n_seq_max=args.slots) as batch:
        def run(order: Order, wait: bool, per_chunk: bool) -> list[float]:
            return prefill_steps(ctx, batch, slots=args.slots, prompt=args.prompt, chunk=args.chunk,
                                 chunks=args.chunks, order=order, wait=wait, per_chunk=per_chunk, vocab=model.n_vocab)

        run(*next(iter(VARIANTS.values())))  # warms the GPU and llama.cpp's graphs up, unrecorded
        for rnd in range(1, args.rounds + 1):
            for name, (order, wait, per_chunk) in VARIANTS.items():
                times = run(order, wait, per_chunk)
                row = {"steps": len(times), "total_ms": sum(times), "mean_ms": sum(times) / len(times),
                       "median_ms": statistics.median(times), "first_ms": times[0]}
                results[name].append(row)
                print(f"round {rnd} {name:<38} {row['steps']} steps: {row['total_ms']:8.1f} ms, "
                      f"{row['mean_ms']:6.2f} ms a step (median {row['median_ms']:6.2f})", flush=True)
        decode = decode_steps(ctx, batch, slots=args.slots, prompt=args.prompt, steps=args.decode_steps)
        print(f"decode steps of {args.slots} rows after {args.prompt} tokens: {decode['decode_ms']:.2f} ms a step, "
              f"{decode['decode_argmax_ms']:.2f} with the picks read", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "args": vars(args), "results": results, "decode": decode}, f, indent=2)


if __name__ == "__main__":
    main()
