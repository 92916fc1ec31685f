"""The layer streamer's plan, checks and arithmetic: everything about streaming that needs no GPU.

:class:`kvrt.stream.streamer.LayerStreamer` executes a :func:`plan` op by op on two CUDA
streams; this module decides what those ops are, refuses bad configurations before
anything is allocated, replays a plan on a timeline (:func:`simulate`, the ideal
makespan for given per-layer times, and the hazard check the tests run) and turns
measured times into the report's ratios.

Serial and overlapped are the same plan with a different *depth*: the transfer of
layer ``i`` waits for the compute of layer ``i - depth``. Depth 1 is the serial
baseline (every copy waits for the previous compute, every compute for its copy);
depth 2 is the ping-pong: layer ``i + 1`` copies into the other slot while ``i``
computes. Both use device-side event waits only, so the ratio between them measures
overlap and nothing else (no host round trips in either).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from statistics import fmean

from kvrt.errors import KvrtError

N_SLOTS = 2
POOL_ALIGN = 4096            # each layer starts on a page in the pinned pool
PINNABLE_FRACTION = 0.8      # of MemAvailable: pinning the rest would starve the OS and other processes


class StreamError(KvrtError):
    """The layer streamer refused or failed."""


class StreamConfigError(StreamError):
    """The streaming configuration itself is impossible (no layers, a layer larger than a slot)."""


class StreamMemoryError(StreamError):
    """The pinned pool or the device slots would not fit in the memory there is."""


class NoGpuError(StreamError):
    """No CUDA GPU (or no CuPy) on this machine: the streamer needs one."""


@dataclass(frozen=True)
class StreamConfig:
    """Layer sizes in bytes (layers may differ) and the size of each of the two device slots."""

    layer_bytes: tuple[int, ...]
    slot_bytes: int

    @classmethod
    def uniform(cls, n_layers: int, bytes_per_layer: int, slot_bytes: int | None = None) -> StreamConfig:
        return cls((bytes_per_layer,) * n_layers, bytes_per_layer if slot_bytes is None else slot_bytes)

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each layer in the pinned pool (page-aligned)."""
        offsets, at = [], 0
        for nbytes in self.layer_bytes:
            offsets.append(at)
            at += -(-nbytes // POOL_ALIGN) * POOL_ALIGN
        return tuple(offsets)

    @property
    def pool_bytes(self) -> int:
        return self.offsets[-1] + self.layer_bytes[-1] if self.layer_bytes else 0

    def check(self) -> None:
        """Refuse a configuration no machine could run (no system query, no allocation)."""
        if self.n_layers == 0:
            raise StreamConfigError("a layer streamer needs at least one layer, got 0")
        bad = [(i, b) for i, b in enumerate(self.layer_bytes) if b <= 0]
        if bad:
            raise StreamConfigError(f"layer sizes must be positive; layer {bad[0][0]} has {bad[0][1]} bytes")
        if self.slot_bytes <= 0:
            raise StreamConfigError(f"slot size must be positive, got {self.slot_bytes} bytes")
        largest = max(range(self.n_layers), key=self.layer_bytes.__getitem__)
        if self.layer_bytes[largest] > self.slot_bytes:
            raise StreamConfigError(
                f"layer {largest} has {self.layer_bytes[largest]} bytes, more than a device slot "
                f"({self.slot_bytes} bytes)")

    def check_memory(self, *, host_available: int, device_free: int) -> None:
        """Refuse a pool or slots larger than the memory this machine can give them."""
        pinnable = int(host_available * PINNABLE_FRACTION)
        if self.pool_bytes > pinnable:
            raise StreamMemoryError(
                f"pinned pool of {self.n_layers} layers needs {self.pool_bytes} bytes; at most {pinnable} "
                f"can be pinned ({PINNABLE_FRACTION:.0%} of {host_available} bytes available on the host)")
        if N_SLOTS * self.slot_bytes > device_free:
            raise StreamMemoryError(
                f"{N_SLOTS} device slots of {self.slot_bytes} bytes need {N_SLOTS * self.slot_bytes} bytes; "
                f"the GPU has {device_free} bytes free")


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what could be pinned without swapping), else physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Stream(Enum):
    TRANSFER = "transfer"
    COMPUTE = "compute"


class Kind(Enum):
    RECORD = "record"   # record event (name, layer) on the stream
    WAIT = "wait"       # the stream waits for event (name, layer); the host does not
    COPY = "copy"       # host layer -> device slot, asynchronously on the transfer stream
    WORK = "work"       # the caller's work for the layer over its slot, on the compute stream


EVENTS = ("transfer_start", "transfer_end", "compute_start", "compute_end")


@dataclass(frozen=True)
class Op:
    stream: Stream
    kind: Kind
    layer: int
    slot: int = -1
    event: str = ""


def plan(n_layers: int, *, overlapped: bool) -> list[Op]:
    """The ops of one pass over ``n_layers`` layers, in the order the host enqueues them."""
    depth = N_SLOTS if overlapped else 1
    ops: list[Op] = []
    for i in range(n_layers):
        slot = i % N_SLOTS
        if i >= depth:  # the slot (or, serially, the GPU) is free once that compute has ended
            ops.append(Op(Stream.TRANSFER, Kind.WAIT, i - depth, event="compute_end"))
        ops += [Op(Stream.TRANSFER, Kind.RECORD, i, event="transfer_start"),
                Op(Stream.TRANSFER, Kind.COPY, i, slot),
                Op(Stream.TRANSFER, Kind.RECORD, i, event="transfer_end"),
                Op(Stream.COMPUTE, Kind.WAIT, i, event="transfer_end"),
                Op(Stream.COMPUTE, Kind.RECORD, i, event="compute_start"),
                Op(Stream.COMPUTE, Kind.WORK, i, slot),
                Op(Stream.COMPUTE, Kind.RECORD, i, event="compute_end")]
    return ops


@dataclass(frozen=True)
class Interval:
    kind: Kind
    layer: int
    slot: int
    start: float
    end: float


def simulate(ops: Sequence[Op], transfer: Sequence[float], compute: Sequence[float]) -> list[Interval]:
    """Replay ``ops`` with CUDA stream semantics and the given per-layer durations.

    Each stream runs its ops in order; a wait holds its stream until the event's
    time; the two streams run concurrently. Returns the copy and work intervals, from
    which the ideal makespan and any slot hazard can be read.
    """
    clock = {Stream.TRANSFER: 0.0, Stream.COMPUTE: 0.0}
    events: dict[tuple[str, int], float] = {}
    intervals: list[Interval] = []
    for op in ops:
        now = clock[op.stream]
        if op.kind is Kind.RECORD:
            events[(op.event, op.layer)] = now
        elif op.kind is Kind.WAIT:
            if (op.event, op.layer) not in events:
                raise StreamError(f"plan waits on {op.event}[{op.layer}] before it is recorded")
            clock[op.stream] = max(now, events[(op.event, op.layer)])
        else:
            length = (transfer if op.kind is Kind.COPY else compute)[op.layer]
            intervals.append(Interval(op.kind, op.layer, op.slot, now, now + length))
            clock[op.stream] = now + length
    return intervals


def makespan(intervals: Sequence[Interval]) -> float:
    return max(iv.end for iv in intervals) - min(iv.start for iv in intervals)


@dataclass(frozen=True)
class RunTimes:
    """Per-layer times of one pass, from CUDA events, in milliseconds."""

    transfer_ms: tuple[float, ...]
    compute_ms: tuple[float, ...]
    total_ms: float  # first transfer start to last compute end


@dataclass(frozen=True)
class StreamReport:
    """The seed's headline numbers and the ones it never reported, for one configuration."""

    serial_ms: float
    overlapped_ms: float
    transfer_ms: float          # mean per-layer copy time in the serial pass (no contention)
    compute_ms: float           # mean per-layer work time in the serial pass
    ideal_speedup: float        # (T + C) / max(T, C): the limit for many layers
    pipeline_ideal_speedup: float  # the same measured T_i, C_i replayed through the plan: the limit for these n layers
    h2d_gbps: float             # bytes / copy time during the overlapped pass
    peak_h2d_gbps: float        # bytes / time of a transfer-only pass in the same run

    @property
    def speedup(self) -> float:
        return self.serial_ms / self.overlapped_ms

    @property
    def savings(self) -> float:
        return 1.0 - self.overlapped_ms / self.serial_ms

    @property
    def efficiency(self) -> float:
        """Measured speedup over (T + C) / max(T, C); below 1 by the pipeline's fill and drain alone."""
        return self.speedup / self.ideal_speedup

    @property
    def pipeline_efficiency(self) -> float:
        """Measured speedup over the best any schedule of these n layers could do."""
        return self.speedup / self.pipeline_ideal_speedup

    @property
    def h2d_fraction(self) -> float:
        return self.h2d_gbps / self.peak_h2d_gbps

    def headline(self) -> str:
        """The seed's line, in its exact format."""
        return (f"HEADLINE: serial={self.serial_ms:.2f} ms, overlapped={self.overlapped_ms:.2f} ms, "
                f"savings={100 * self.savings:.2f}%, speedup={self.speedup:.3f}x")

    def detail(self) -> str:
        return (f"T={self.transfer_ms:.3f} ms/layer, C={self.compute_ms:.3f} ms/layer, "
                f"ideal={self.ideal_speedup:.3f}x (n-layer bound {self.pipeline_ideal_speedup:.3f}x), "
                f"efficiency={self.efficiency:.3f} (vs n-layer bound {self.pipeline_efficiency:.3f}), "
                f"H2D={self.h2d_gbps:.1f} GB/s of peak {self.peak_h2d_gbps:.1f} GB/s ({100 * self.h2d_fraction:.1f}%)")


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6)


def report(serial: RunTimes, overlapped: RunTimes, transfer_only: RunTimes,
           layer_bytes: Sequence[int]) -> StreamReport:
    """Ratios from three passes over the same layers; ideals come from the serial pass's own times."""
    t, c = fmean(serial.transfer_ms), fmean(serial.compute_ms)
    bound = makespan(simulate(plan(len(layer_bytes), overlapped=True), serial.transfer_ms, serial.compute_ms))
    total_bytes = sum(layer_bytes)
    return StreamReport(
        serial_ms=serial.total_ms,
        overlapped_ms=overlapped.total_ms,
        transfer_ms=t,
        compute_ms=c,
        ideal_speedup=(t + c) / max(t, c),
        pipeline_ideal_speedup=(sum(serial.transfer_ms) + sum(serial.compute_ms)) / bound,
        h2d_gbps=gbps(total_bytes, sum(overlapped.transfer_ms)),
        peak_h2d_gbps=gbps(total_bytes, transfer_only.total_ms),
    )
