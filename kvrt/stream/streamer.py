"""LayerStreamer: keep two layers on the GPU, stream the rest from pinned host memory.

One pinned host pool holds every layer (allocated once, reused by every pass), two
device slots take turns (ping-pong), a transfer stream copies and a compute stream
runs the caller's work, and four CUDA events per layer time and order it all. The
ops come from :func:`kvrt.stream.streamplan.plan`; this module only executes them, so the
ordering that the CPU tests prove (no layer computed before its copy ends, no slot
overwritten while it is read) is the ordering the GPU runs.

Inside a pass the host never waits: copies and computes are ordered by
``stream.wait_event``. The host synchronises once before a pass (so work the caller
queued elsewhere, e.g. resetting its output on the default stream, is done) and once
after it (to read the events).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvrt.stream.streamplan import (
    EVENTS,
    N_SLOTS,
    Kind,
    NoGpuError,
    RunTimes,
    Stream,
    StreamConfig,
    StreamError,
    host_available_bytes,
    plan,
)
from kvrt.system.gpu import cupy_with_device

Work = Callable[[int, Any], None]
"""``work(layer, slot)``: enqueue layer ``layer``'s compute over ``slot`` (a CuPy uint8
array of exactly that layer's bytes) on CuPy's current stream, which is the compute
stream while it runs. It must not synchronise the host."""


def _cupy() -> Any:
    """CuPy with at least one CUDA device, or :class:`NoGpuError` saying what is missing."""
    cupy, reason = cupy_with_device()
    if cupy is None:
        raise NoGpuError(f"the layer streamer needs CuPy and a CUDA GPU; {reason}")
    return cupy


class LayerStreamer:
    """Pinned pool + two device slots + transfer/compute streams + per-layer events.

    Checks happen before anything is allocated: the configuration itself, then that
    a GPU is there, then that the pool fits in pinnable host memory and the slots in
    free device memory. Fill the layers through :meth:`host_layer`, then call
    :meth:`run` as often as needed: every pass reuses the same allocations.
    """

    def __init__(self, config: StreamConfig) -> None:
        config.check()
        cp = _cupy()
        free, _total = cp.cuda.runtime.memGetInfo()
        config.check_memory(host_available=host_available_bytes(), device_free=free)
        self.config = config
        self._cp = cp
        self._pinned = cp.cuda.alloc_pinned_memory(config.pool_bytes)
        self._host = np.ndarray((config.pool_bytes,), dtype=np.uint8, buffer=self._pinned)
        self._slots = [cp.empty(config.slot_bytes, dtype=cp.uint8) for _ in range(N_SLOTS)]
        self._streams = {s: cp.cuda.Stream(non_blocking=True) for s in Stream}
        self._events = {name: [cp.cuda.Event() for _ in range(config.n_layers)] for name in EVENTS}

    def host_layer(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s bytes in the pinned pool (a writable uint8 view; fill it before :meth:`run`)."""
        start = self.config.offsets[layer]
        return self._host[start:start + self.config.layer_bytes[layer]]

    def slot(self, index: int) -> Any:
        """Device slot ``index`` (0 or 1), its full ``slot_bytes`` (for tests that poison it)."""
        return self._slots[index]

    @property
    def compute_stream(self) -> Any:
        return self._streams[Stream.COMPUTE]

    def run(self, work: Work, *, overlapped: bool) -> RunTimes:
        """One pass over every layer, serial or overlapped; returns the per-layer event times."""
        cp = self._cp
        cp.cuda.Device().synchronize()
        for op in plan(self.config.n_layers, overlapped=overlapped):
            stream = self._streams[op.stream]
            if op.kind is Kind.RECORD:
                self._events[op.event][op.layer].record(stream)
            elif op.kind is Kind.WAIT:
                stream.wait_event(self._events[op.event][op.layer])
            elif op.kind is Kind.COPY:
                self._copy(op.layer, op.slot, stream)
            else:
                with stream:
                    work(op.layer, self._slots[op.slot][:self.config.layer_bytes[op.layer]])
        last = self._events["compute_end"][-1]
        last.synchronize()
        return self._times()

    def _copy(self, layer: int, slot: int, stream: Any) -> None:
        rt = self._cp.cuda.runtime
        rt.memcpyAsync(self._slots[slot].data.ptr, self._pinned.ptr + self.config.offsets[layer],
                       self.config.layer_bytes[layer], rt.memcpyHostToDevice, stream.ptr)

    def _times(self) -> RunTimes:
        elapsed = self._cp.cuda.get_elapsed_time
        ev = self._events
        n = self.config.n_layers
        return RunTimes(
            transfer_ms=tuple(elapsed(ev["transfer_start"][i], ev["transfer_end"][i]) for i in range(n)),
            compute_ms=tuple(elapsed(ev["compute_start"][i], ev["compute_end"][i]) for i in range(n)),
            total_ms=elapsed(ev["transfer_start"][0], ev["compute_end"][-1]),
        )

    def close(self) -> None:
        """Drop the slots, events, streams and the pinned pool (after the last pass has finished)."""
        if not hasattr(self, "_slots"):
            return
        self._cp.cuda.Device().synchronize()
        del self._slots, self._events, self._streams, self._host, self._pinned

    def __enter__(self) -> LayerStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LayerStreamer", "StreamConfig", "StreamError", "NoGpuError", "Work"]
