#!/usr/bin/env python3
"""Where does a swap-in's time go beyond its pinned transfer? (GPU-machine probe, issue 4)

``llama_state_seq_set_data`` restores a sequence in two steps: the cell metadata (one
``std::map`` insertion per cell, a slot search, a verification loop) and then one
synchronous ``cudaMemcpyAsync`` per K and per V tensor of every layer, straight from the
state blob, whose tensor rows start at whatever offset the headers before them leave
(4-byte aligned only). This probe times, on one prefilled 7B-shaped context:

- the restore as kvrt does it (kept context, median of ``--reps``);
- the same bytes as one pinned H2D copy (the floor), from the snapshot's own pool buffer
  and from a fresh pinned buffer;
- the same bytes as llama.cpp copies them: one synchronous copy per tensor at the blob's own
  offsets, the same with every source offset moved to a 4096-byte boundary, and the same
  without the synchronisation between copies;
- the metadata alone: a 1-layer model with a 32-byte KV row holding the same cell count, restored as a
  sequence and as the whole context (the only other public restore);
- one pinned copy from memory allocated while bound to each NUMA node in turn.

and prints the machine's NUMA layout next to the GPU's, because the host pool's pages may
live on a node far from the GPU. Usage: probe_swap_in.py MODEL [--tokens N] [--reps R]
"""

# ruff: noqa: I001  (kvrt first: it maps llama.cpp before NumPy and CuPy are imported)
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import kvrt  # noqa: F401  (loads llama.cpp before NumPy and CuPy: see DEVELOPING.md)
from kvrt import Context, ContextParams, Model
from kvrt.bindings import ffi, lib
from kvrt.engine.generation import prefill
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot
from kvrt.modelfiles.testmodels import Shape, write_model

import cupy
import numpy as np


def tensor_spans(blob: np.ndarray) -> list[tuple[int, int]]:
    """(offset, size) of every K/V tensor payload in a one-stream sequence state blob."""
    raw = blob.tobytes()
    off = 8  # io magic, source seq id

    def u32() -> int:
        nonlocal off
        (value,) = struct.unpack_from("<I", raw, off)
        off += 4
        return value

    if u32() != 1:
        raise ValueError("probe handles one KV stream only")
    cells = u32()
    for _ in range(cells):
        u32()  # pos
        n_seq = u32()
        off += 4 * n_seq  # seq ids
    v_trans, n_layer = u32(), u32()
    if v_trans:
        raise ValueError("V is transposed (flash attention off): one copy per V row, not per tensor")
    spans = []
    for _ in range(2 * n_layer):
        off += 4  # type
        (row,) = struct.unpack_from("<Q", raw, off)
        off += 8
        spans.append((off, row * cells))
        off += row * cells
    if off != len(raw):
        raise ValueError(f"parse ended at {off}, blob has {len(raw)} bytes")
    return spans


def timed(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copies(dst: cupy.ndarray, src: np.ndarray, spans: list[tuple[int, int]], stream: cupy.cuda.Stream,
           sync_each: bool, shift: int = 0) -> Callable[[], None]:
    def run() -> None:
        for off, size in spans:
            start = off - (off % 4096) if shift else off
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr + start, src.ctypes.data + start, size, 1, stream.ptr)
            if sync_each:
                stream.synchronize()
        stream.synchronize()
    return run


def numa_report() -> dict[str, str]:
    out = {}
    for name, cmd in (("gpu_topology", ["nvidia-smi", "topo", "-m"]), ("numactl", ["numactl", "--hardware"]),
                      ("lscpu", ["lscpu"])):
        try:
            out[name] = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            out[name] = f"unavailable: {exc}"
    out["affinity"] = str(sorted(os.sched_getaffinity(0)))
    return out


def pinned_per_node(nbytes: int, reps: int) -> dict[str, float]:
    """One-copy H2D of ``nbytes`` from pinned memory allocated while bound to each NUMA node's CPUs."""
    dev = cupy.empty(nbytes, dtype=cupy.uint8)
    mine = os.sched_getaffinity(0)
    out = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus = _cpulist((node / "cpulist").read_text()) & mine
        if not cpus:
            continue
        os.sched_setaffinity(0, cpus)
        try:
            host = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), dtype=np.uint8, count=nbytes)
            host[::4096] = 1  # touched here, on this node
            out[node.name] = timed(copies(dev, host, [(0, nbytes)], cupy.cuda.Stream.ptds, False), reps)
            del host
        finally:
            os.sched_setaffinity(0, mine)
    del dev
    return out


def _cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def metadata_only(n_tokens: int, reps: int) -> dict[str, float]:
    """A restore whose tensor bytes are negligible, as a sequence (``llama_state_seq_set_data``) and as the
    whole context (``llama_state_set_data``: the same cell records behind the architecture name instead of
    the sequence header; llama.cpp empties the context, then adds each cell to its sequence)."""
    shape = Shape(label="metadata probe", n_layer=1, n_embd=32, n_head=1, n_head_kv=1, n_ff=32, n_vocab=512,
                  n_ctx_train=max(65536, n_tokens + 256))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "meta.gguf"
        write_model(path, shape)
        with Model(path) as model, Context(model, ContextParams(n_ctx=n_tokens + 256, n_batch=2048)) as ctx:
            prefill(ctx, [(7 * i) % 500 + 5 for i in range(n_tokens)], logits_last=False)
            snap = Snapshot.capture(ctx, 0, pool=HostPool())

            def restore() -> None:
                ctx.clear()
                snap.restore(ctx, 0)
                ctx.synchronize()
            seq_ms = timed(restore, reps)
            nbytes = snap.nbytes
            snap.release()
            whole = np.empty(lib().llama_state_get_size(ctx.ptr), dtype=np.uint8)
            written = lib().llama_state_get_data(ctx.ptr, ffi.from_buffer("uint8_t[]", whole), whole.nbytes)

            def restore_whole() -> None:
                if lib().llama_state_set_data(ctx.ptr, ffi.from_buffer("uint8_t[]", whole), written) != written:
                    raise RuntimeError("llama_state_set_data refused the whole-context state")
                ctx.synchronize()
            whole_ms = timed(restore_whole, reps)
    return {"metadata_only_ms": seq_ms, "metadata_only_state_bytes": nbytes,
            "metadata_only_whole_context_ms": whole_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    result: dict[str, object] = {"numa": numa_report()}
    with Model(args.model) as model:
        params = ContextParams(n_ctx=args.tokens + 256, n_batch=2048)
        with Context(model, params) as ctx:
            doc = [(7 * i) % 1000 + 5 for i in range(args.tokens)]
            prefill(ctx, doc, logits_last=False)
            ctx.synchronize()
            pool = HostPool()
            snap = Snapshot.capture(ctx, 0, pool=pool)
            with snap.store.host_bytes(snap.identity) as blob:  # the probe reads the bytes llama.cpp reads
                pass  # a host store's view: the buffer itself, alive until the snapshot is released
            spans = tensor_spans(blob)

            def restore() -> None:
                ctx.clear()  # untimed in the benchmark; here in the loop, so timed separately below
                snap.restore(ctx, 0)
                ctx.synchronize()
            clear_ms = timed(ctx.clear, args.reps)
            result["restore_kept_ms"] = timed(restore, args.reps) - clear_ms
            result["clear_ms"] = clear_ms
            result.update(state_bytes=snap.nbytes, tensors=len(spans), tensor_bytes=sum(s for _, s in spans),
                          pinned=snap.pinned, offsets_mod_16=sorted({o % 16 for o, _ in spans}))
            dev = cupy.empty(snap.nbytes + 4096, dtype=cupy.uint8)
            ptds = cupy.cuda.Stream.ptds
            whole = [(0, snap.nbytes)]
            result["h2d_one_copy_pool_buffer_ms"] = timed(copies(dev, blob, whole, ptds, False), args.reps)
            result["h2d_per_tensor_sync_each_ms"] = timed(copies(dev, blob, spans, ptds, True), args.reps)
            result["h2d_per_tensor_aligned_sync_each_ms"] = timed(copies(dev, blob, spans, ptds, True, 1), args.reps)
            result["h2d_per_tensor_no_sync_ms"] = timed(copies(dev, blob, spans, ptds, False), args.reps)
            fresh = np.frombuffer(cupy.cuda.alloc_pinned_memory(snap.nbytes), dtype=np.uint8, count=snap.nbytes)
            result["h2d_one_copy_fresh_pinned_ms"] = timed(copies(dev, fresh, whole, ptds, False), args.reps)
            snap.release()
            del dev
    result.update(metadata_only(args.tokens, args.reps))
    for node, ms in pinned_per_node(int(result["state_bytes"]), args.reps).items():
        result[f"h2d_one_copy_pinned_on_{node}_ms"] = ms
    floor = result["h2d_one_copy_fresh_pinned_ms"]
    for key, value in result.items():
        if key != "numa":
            extra = f"  ({value / floor:.2f}x the fresh one-copy floor)" if key.endswith("_ms") else ""
            print(f"{key}: {value:.2f}{extra}" if isinstance(value, float) else f"{key}: {value}")
    print(result["numa"]["gpu_topology"])
    print("affinity:", result["numa"]["affinity"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
