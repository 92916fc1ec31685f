"""Agent switching: one agent's KV state out to host memory and back, against re-prefill, the ideal and the peer.

Per document length and trial (>= 3 trials; medians with min-max):

- re-prefill (the baseline: what an agent whose KV was dropped pays), in the kept,
  warm context emptied first;
- kvrt swap-out (:meth:`Snapshot.capture` into the host pool, pinned where CUDA is)
  and swap-in (restore into the kept context, and into a fresh one);
- the ideal: the same bytes moved once at the machine's measured speed. On a GPU
  machine a pinned host-to-device copy (CuPy, CUDA events: the PCIe bandwidth); on a
  CPU one host memcpy into a preallocated buffer (NumPy) -- labelled which;
- the peer: llama-cpp-python's ``Llama`` over the same GGUF and document, its state
  saved with ``save_state`` into ``LlamaRAMCache`` / ``LlamaDiskCache`` and loaded
  back with ``load_state`` (``disk``: pickled to and read from the cache folder);
- the switch as a user sees it (``switch_ttft``): a cleared context, then the agent's
  state back and one probe token decoded to its logits. kvrt: restore + decode. Peer:
  ``create_completion(document + probe, max_tokens=1)``, which finds the cached state,
  loads it, reuses the document prefix and evaluates the probe.

Exactness: kvrt's next-token logits after the round trip against before it (bit for
bit), and the peer's greedy next token after its round trip against kvrt's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot
from kvrt_bench._bounds import Bound, ideal_bound
from kvrt_bench._stats import summarize

SENTENCE = "The quick brown fox jumps over the lazy dog. "
IDEAL_REPEATS = 5


def document(model: Model, n_tokens: int) -> list[int]:
    """``n_tokens`` ids: BOS (if any) and the fox sentence repeated."""
    sentence = model.tokenize(SENTENCE, add_special=False)
    head = model.tokenize("", add_special=True)
    return (head + sentence * (n_tokens // len(sentence) + 1))[:n_tokens]


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return (time.perf_counter() - t0) * 1e3, value


def pinned_h2d_ms(nbytes: int) -> float | None:
    """Median pinned host-to-device copy of ``nbytes`` (CUDA events), or None without CuPy or a GPU."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
    except cupy.cuda.runtime.CUDARuntimeError:
        return None
    host = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), dtype=np.uint8, count=nbytes)
    dev = cupy.empty(nbytes, dtype=cupy.uint8)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(IDEAL_REPEATS):
        start.record()
        dev.set(host)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    del dev
    return float(statistics.median(times))


def host_copy_ms(nbytes: int) -> float:
    """Median memcpy of ``nbytes`` between two preallocated, touched host buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(IDEAL_REPEATS):
        ms, _ = _timed(lambda: np.copyto(dst, src))
        times.append(ms)
    return float(statistics.median(times))


def ideal_transfer(nbytes: int) -> tuple[float, str]:
    """The ideal swap-in of ``nbytes`` and what it is: the pinned PCIe copy on a GPU machine, else a memcpy."""
    h2d = pinned_h2d_ms(nbytes)
    if h2d is not None:
        return h2d, "pinned host-to-device copy (CuPy, CUDA events)"
    return host_copy_ms(nbytes), "host memcpy (NumPy copyto; no GPU on this machine)"


def next_logits(ctx: Context, batch: Batch, token: int, pos: int) -> np.ndarray:
    """Logits of ``token`` decoded at ``pos`` of sequence 0; the token is removed again."""
    batch.clear()
    batch.add(token, pos, 0, logits=True)
    ctx.decode(batch)
    logits = ctx.logits(0).copy()
    ctx.seq_rm(0, pos, -1)
    return logits


@dataclass
class KvrtTrial:
    reprefill_ms: float
    swap_out_ms: float
    swap_in_kept_ms: float
    swap_in_fresh_ms: float
    switch_ttft_ms: float
    exact: bool
    nbytes: int
    pinned: bool


def kvrt_trial(model: Model, ctx: Context, batch: Batch, params: ContextParams, doc: list[int], probe: int,
               reference: np.ndarray, pool: HostPool) -> KvrtTrial:
    """One round trip on kvrt, and one re-prefill in the same (emptied) context."""
    ctx.clear()
    reprefill_ms, _ = _timed(lambda: (prefill(ctx, doc, logits_last=False), ctx.synchronize()))
    out_ms, snap = _timed(lambda: Snapshot.capture(ctx, 0, pool=pool))
    try:
        ctx.clear()
        in_ms, _ = _timed(lambda: (snap.restore(ctx, 0), ctx.synchronize()))
        exact = bool(np.array_equal(reference, next_logits(ctx, batch, probe, len(doc))))
        ctx.clear()
        switch_ms, _ = _timed(lambda: (snap.restore(ctx, 0), next_logits(ctx, batch, probe, len(doc))))
        t0 = time.perf_counter()
        with Context(model, params) as fresh:
            snap.restore(fresh, 0)
            fresh.synchronize()
            fresh_ms = (time.perf_counter() - t0) * 1e3
        return KvrtTrial(reprefill_ms, out_ms, in_ms, fresh_ms, switch_ms, exact, snap.nbytes, snap.pinned)
    finally:
        snap.release()


@dataclass
class PeerTrial:
    swap_out_ms: float
    swap_in_ms: float
    switch_ttft_ms: float
    next_token: int
    nbytes: int


def peer_trial(llm: Any, kind: str, doc: list[int], probe: int, folder: Path) -> PeerTrial:
    """One round trip of the peer's whole-context state through its ``kind`` cache, then a switch.

    The live context holds ``doc`` before and after (restored from the saved state, off the clock).
    """
    import llama_cpp

    cache = (llama_cpp.LlamaRAMCache(capacity_bytes=1 << 40) if kind == "ram"
             else llama_cpp.LlamaDiskCache(str(folder), capacity_bytes=1 << 40))
    key = tuple(doc)

    def save() -> Any:
        state = llm.save_state()
        cache[key] = state
        return state

    def load() -> Any:
        state = cache[key]  # the disk cache unpickles here (and forgets the entry)
        llm.load_state(state)
        return state

    out_ms, state = _timed(save)
    llm.reset()
    in_ms, state = _timed(load)
    llm.eval([probe])
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    token = int(np.argmax(logits))
    cache[key] = state  # untimed: the disk cache forgot it on the read
    llm.reset()
    llm.set_cache(cache)
    switch_ms, _ = _timed(lambda: llm.create_completion(doc + [probe], max_tokens=1, temperature=0.0,
                                                        repeat_penalty=1.0))
    llm.set_cache(None)
    llm.load_state(state)
    return PeerTrial(out_ms, in_ms, switch_ms, token, int(state.llama_state_size))


def _median_columns(prefix: str, values: list[float]) -> dict[str, float]:
    s = summarize(values)
    return {f"{prefix}_ms": s.median, f"{prefix}_ms_min": s.min, f"{prefix}_ms_max": s.max}


def summarize_kvrt(trials: list[KvrtTrial], ideal_ms: float) -> dict[str, Any]:
    row: dict[str, Any] = {"state_bytes": trials[0].nbytes, "pinned": trials[0].pinned, "trials": len(trials),
                           "exact_all_trials": all(t.exact for t in trials)}
    for name in ("reprefill", "swap_out", "swap_in_kept", "swap_in_fresh", "switch_ttft"):
        row.update(_median_columns(name, [getattr(t, f"{name}_ms") for t in trials]))
    row["ideal_ms"] = ideal_ms
    row["ideal_gbps"] = trials[0].nbytes / ideal_ms / 1e6
    row["fraction_of_ideal"] = ideal_ms / row["swap_in_kept_ms"]
    row["swap_in_over_ideal"] = row["swap_in_kept_ms"] / ideal_ms
    row["swap_in_gbps"] = trials[0].nbytes / row["swap_in_kept_ms"] / 1e6
    row["reprefill_over_swap_in"] = row["reprefill_ms"] / row["swap_in_kept_ms"]
    return row


def summarize_peer(trials: list[PeerTrial], ideal_ms: float, kvrt_next_token: int, kvrt_row: dict[str, Any]) -> dict:
    row: dict[str, Any] = {"state_bytes": trials[0].nbytes, "trials": len(trials),
                           "next_token_equals_kvrt": all(t.next_token == kvrt_next_token for t in trials)}
    for name in ("swap_out", "swap_in", "switch_ttft"):
        row.update(_median_columns(name, [getattr(t, f"{name}_ms") for t in trials]))
    row["fraction_of_ideal"] = ideal_ms / row["swap_in_ms"]
    row["kvrt_swap_in_speedup"] = row["swap_in_ms"] / kvrt_row["swap_in_kept_ms"]
    row["kvrt_switch_ttft_speedup"] = row["switch_ttft_ms"] / kvrt_row["switch_ttft_ms"]
    return row


def swap_bounds(row: dict[str, Any]) -> list[Bound]:
    """kvrt's and each peer's swap-in: no faster than moving the bytes once at the measured speed."""
    where = f"swap {row['model']} {row['doc_tokens']} tokens"
    bounds = [ideal_bound(f"{where}: kvrt swap-in fraction of the ideal", row["kvrt"]["fraction_of_ideal"],
                          row["ideal_kind"])]
    for kind, peer in row.get("peer", {}).items():
        bounds.append(ideal_bound(f"{where}: peer-{kind} load_state fraction of the ideal",
                                  peer["fraction_of_ideal"], row["ideal_kind"]))
    return bounds
