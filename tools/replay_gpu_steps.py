"""Replay issue 24's private and swarm workloads through kvrt's engine on the CPU, with a GPU's step times modelled.

What: :class:`kvrt.runtime.batching.Engine` runs on the tiny test model, but its step layout decides with the bytes
of the Qwen2.5-7B shape (15.2 GB of F16 weights, 57,344 bytes of K/V a cell), its decode wait reads a modelled
clock, and its host tier holds as many tokens as 8 GiB holds of that shape. Each decoded step's time is modelled
from the micro-batches llama.cpp splits it into (:func:`kvrt.engine.micro_batches.split_per_stream`): 9.5 ms a
weight pass, 0.0215 ms a token, each micro-batch's K/V read at 3 TB/s (fitted to the H100 step traces of
2026-12-05 and 06), plus ``--host-ms`` a step. Agents are threads sending token-id turns as ``kvrt bench peer``
does: ``private`` (each its own history, then a turn appending 64 tokens), ``swarm`` (one shared document plus a
task each, then turns appending 128 tokens), 64 tokens generated a turn.

Why: it reproduces the engine's decisions at the GPU's sizes on a 2-core machine (which requests share a step,
which slot is evicted or held, how many micro-batches a step takes), so layouts can be compared before a GPU run.
A model, not a measurement: the hold of a finished turn's slot and the layout's settle wait run on wall time, and
this machine's steps are slower than a GPU's.

It sets two of the engine's private parts on purpose, the seams a replay needs and no user should: the step
layout's byte counts and clock (``Engine._filler``) and the per-step accounting hook (``Engine._account``).

Usage: ``python tools/replay_gpu_steps.py private --agents 64`` (``--set hold_s=0`` for an EngineConfig option).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvrt.engine.generation import GenerationParams
from kvrt.engine.micro_batches import split_per_stream
from kvrt.engine.model import Model
from kvrt.modelfiles.testmodels import write_model
from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import EngineStats, Request

WEIGHT_BYTES = 15_200_000_000
CELL_BYTES = 57_344
HOST_TIER_BYTES = 8 << 30
PASS_MS, TOKEN_MS, KV_BYTES_PER_MS = 9.5, 0.0215, 3e9
GEN = 64


@dataclass(frozen=True)
class Sizes:
    """One workload's prompts: a shared prefix (0: none), each agent's own part, turns, tokens appended a turn."""

    shared: int
    own: int
    turns: int
    append: int


WORKLOADS = {"private": Sizes(0, 4096, 2, 64), "swarm": Sizes(4096, 64, 4, 128)}


@dataclass(frozen=True)
class Replay:
    """What one replay did: its steps, their micro-batches, the modelled seconds, the engine's counters, and the
    output tokens its turns lacked (0: every turn got all it asked for)."""

    steps: int
    micro_batches: int
    modelled_s: float
    stats: EngineStats
    lost: int


def step_ms(shape: list[tuple[int, int]], held: dict[int, int], *, n_ubatch: int,
            pool_cells: int | None = None) -> tuple[int, float]:
    """A step's micro-batches and modelled milliseconds, from its (slot, tokens) shape and each slot's cells before
    it. ``pool_cells``: one pool (unified) holding that many used cells after the step: micro-batches of
    ``n_ubatch`` tokens in order, each reading all of those cells' K/V."""
    if pool_cells is not None:
        tokens = sum(t for _, t in shape)
        parts = -(-tokens // n_ubatch)
        return parts, parts * (PASS_MS + pool_cells * CELL_BYTES / KV_BYTES_PER_MS) + tokens * TOKEN_MS
    ms = 0.0
    micro = split_per_stream(shape, n_ubatch)
    for part in micro:
        kv = len(part) * max(held.get(seq, 0) + n for seq, n in part.items()) * CELL_BYTES
        ms += PASS_MS + sum(part.values()) * TOKEN_MS + kv / KV_BYTES_PER_MS
    return len(micro), ms


def replay(workload: str, *, agents: int = 32, cells: int = 163_840, sizes: Sizes | None = None,
           host_ms: float = 2.5, seed: int = 0, **overrides: object) -> Replay:
    """Run ``workload`` (or ``sizes``) with ``agents`` at once through an engine with issue 24's peer settings
    (``n_seq_max = agents``, ``cells``, 2,048 tokens a step in chunks of 512) and ``overrides`` of them."""
    sizes = sizes or WORKLOADS[workload]
    host_bytes = HOST_TIER_BYTES // CELL_BYTES * 1024  # the tiny model's 1 KiB cells, as many as 8 GiB of the 7B's
    config = EngineConfig(n_ctx=cells, n_seq_max=agents, n_batch=2048, prefill_chunk=512, flash_attn="off",
                          host_bytes=host_bytes, **overrides)  # type: ignore[arg-type]
    now = 0.0  # the modelled clock the decode wait reads: the steps' modelled times summed
    steps = micro_batches = 0
    total_ms = 0.0
    with tempfile.TemporaryDirectory() as folder:
        model = Model(write_model(Path(folder) / "tiny.gguf", "tiny"))
        try:
            engine = Engine(model, config)
            engine._filler._weight_bytes, engine._filler._cell_bytes = WEIGHT_BYTES, CELL_BYTES
            engine._filler._clock = lambda: now
            account = engine._account

            def modelled(step, times):  # type: ignore[no-untyped-def]
                nonlocal now, steps, micro_batches, total_ms
                shape = step.shape
                held = {seq: max(0, engine.cache.held(seq) - tokens) for seq, tokens in shape}
                parts, ms = step_ms(shape, held, n_ubatch=engine.ctx.params.n_ubatch,
                                    pool_cells=engine.cache.used_cells if engine.cache.shared else None)
                now += (ms + host_ms) / 1e3
                steps, micro_batches, total_ms = steps + 1, micro_batches + parts, total_ms + ms + host_ms
                account(step, times)

            engine._account = modelled  # type: ignore[method-assign]
            with engine:
                lost = _run_agents(engine, model.n_vocab, agents, sizes, seed)
                stats = engine.stats()
        finally:
            model.close()
    return Replay(steps, micro_batches, total_ms / 1e3, stats, lost)


def _run_agents(engine: Engine, n_vocab: int, agents: int, sizes: Sizes, seed: int) -> int:
    """Every agent's turns, all agents at once, each turn the last prompt, its output and new tokens; returns the
    output tokens the turns lacked."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(10, n_vocab - 10, sizes.shared).tolist()
    firsts = [shared + rng.integers(10, n_vocab - 10, sizes.own).tolist() for _ in range(agents)]
    appends = [[rng.integers(10, n_vocab - 10, sizes.append).tolist() for _ in range(sizes.turns - 1)]
               for _ in range(agents)]
    lost = [0] * agents

    def agent(i: int) -> None:
        prompt = firsts[i]
        for turn in range(sizes.turns):
            result = engine.submit(Request(prompt, GenerationParams(max_tokens=GEN, ignore_eos=True))).result(600)
            tokens = result.choices[0].tokens
            lost[i] += GEN - len(tokens)
            if turn + 1 < sizes.turns:
                prompt = prompt + tokens + appends[i][turn]

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(lost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--cells", type=int, default=163_840)
    parser.add_argument("--host-ms", type=float, default=2.5, help="modelled host time a step")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help="an EngineConfig option, e.g. hold_s=0 or decode_wait_s=0.5 (repeatable)")
    args = parser.parse_args()
    overrides = {name: json.loads(value) for name, _, value in (item.partition("=") for item in args.set)}
    result = replay(args.workload, agents=args.agents, cells=args.cells, host_ms=args.host_ms, **overrides)
    stats = result.stats
    print(f"{args.workload} x {args.agents} {overrides or ''}: {result.steps} steps, {result.micro_batches} "
          f"micro-batches, {result.modelled_s:.2f} s modelled; prefilled {stats.prefilled_tokens}, reused "
          f"{stats.reused_tokens}, restored {stats.restored_tokens}; {stats.host_kept} host copies; layout "
          f"{stats.kv_layout}, {len(stats.slots)} slots, {stats.relayouts} relayouts; lost {result.lost}")


if __name__ == "__main__":
    main()
