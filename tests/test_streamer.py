"""The layer streamer: its plan and arithmetic on any machine, its passes on a GPU.

CPU: the plan is replayed on a timeline with arbitrary per-layer durations and must
never compute a layer before its copy ends nor copy into a slot still being read;
bad configurations are refused before anything is allocated; the report's ratios.
GPU: serial and overlapped passes give bit-identical results, also when every slot
is poisoned right after its layer is used; the real-layer mode matches NumPy.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrt.errors import KvrtError
from kvrt.stream.streamplan import (
    POOL_ALIGN,
    Kind,
    RunTimes,
    StreamConfig,
    StreamConfigError,
    StreamMemoryError,
    makespan,
    plan,
    report,
    simulate,
)

durations = st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=12)


def assert_no_hazard(intervals) -> None:
    copies = {iv.layer: iv for iv in intervals if iv.kind is Kind.COPY}
    works = {iv.layer: iv for iv in intervals if iv.kind is Kind.WORK}
    assert sorted(copies) == sorted(works) == list(range(len(copies)))
    for layer, work in works.items():
        copy = copies[layer]
        assert work.slot == copy.slot
        assert work.start >= copy.end, f"layer {layer} computed before its copy ended"
        for other in copies.values():  # no copy into this slot while this layer is being read
            if other.slot == work.slot and other.layer != layer:
                assert other.end <= copy.start or other.start >= work.end, (
                    f"copy of layer {other.layer} overlaps the use of layer {layer} in slot {work.slot}")
    assert [w.layer for w in sorted(works.values(), key=lambda w: w.start)] == sorted(works)


@given(data=st.data(), overlapped=st.booleans())
def test_plan_never_reads_early_or_overwrites_a_slot_in_use(data: st.DataObject, overlapped: bool) -> None:
    transfer = data.draw(durations)
    compute = data.draw(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=len(transfer),
                                 max_size=len(transfer)))
    assert_no_hazard(simulate(plan(len(transfer), overlapped=overlapped), transfer, compute))


@given(data=st.data())
def test_serial_plan_takes_the_sum_and_overlapped_the_pipeline_bound(data: st.DataObject) -> None:
    transfer = data.draw(durations)
    compute = data.draw(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=len(transfer),
                                 max_size=len(transfer)))
    n = len(transfer)
    serial = makespan(simulate(plan(n, overlapped=False), transfer, compute))
    assert serial == pytest.approx(sum(transfer) + sum(compute))
    # two-slot pipeline recurrence: copy i starts after copy i-1 and compute i-2; compute i after copy i and compute i-1
    copy_end, comp_end = [0.0] * n, [0.0] * n
    for i in range(n):
        start = max(copy_end[i - 1] if i else 0.0, comp_end[i - 2] if i >= 2 else 0.0)
        copy_end[i] = start + transfer[i]
        comp_end[i] = max(copy_end[i], comp_end[i - 1] if i else 0.0) + compute[i]
    assert makespan(simulate(plan(n, overlapped=True), transfer, compute)) == pytest.approx(comp_end[-1])


def test_balanced_uniform_layers_approach_two_times() -> None:
    n = 32
    overlapped = makespan(simulate(plan(n, overlapped=True), [1.0] * n, [1.0] * n))
    assert overlapped == pytest.approx(n + 1)  # fill + n steps: 2n / (n + 1) -> 2


def test_layers_are_page_aligned_in_the_pool() -> None:
    config = StreamConfig((5, 4096, 1), slot_bytes=4096)
    assert config.offsets == (0, POOL_ALIGN, 2 * POOL_ALIGN)
    assert config.pool_bytes == 2 * POOL_ALIGN + 1


@pytest.mark.parametrize(("config", "words"), [
    (StreamConfig.uniform(0, 1024), ["at least one layer", "0"]),
    (StreamConfig((1024, 0), 1024), ["layer 1", "0 bytes"]),
    (StreamConfig((1024, 4096, 2048), 2048), ["layer 1", "4096", "2048"]),
    (StreamConfig.uniform(2, 1024, slot_bytes=0), ["slot", "0"]),
])
def test_impossible_configs_are_refused_with_their_numbers(config: StreamConfig, words: list[str]) -> None:
    with pytest.raises(StreamConfigError) as info:
        config.check()
    assert isinstance(info.value, KvrtError)
    for word in words:
        assert word in str(info.value)


def test_pool_larger_than_pinnable_host_memory_is_refused() -> None:
    config = StreamConfig.uniform(8, 1 << 30)
    with pytest.raises(StreamMemoryError, match=r"8 layers needs 8589934592 bytes.*of 4294967296 bytes available"):
        config.check_memory(host_available=4 << 30, device_free=80 << 30)


def test_slots_larger_than_free_device_memory_are_refused() -> None:
    config = StreamConfig.uniform(2, 1 << 30)
    with pytest.raises(StreamMemoryError, match=r"need 2147483648 bytes; the GPU has 1073741824 bytes free"):
        config.check_memory(host_available=64 << 30, device_free=1 << 30)


def test_streamer_refuses_bad_config_before_looking_for_a_gpu() -> None:
    from kvrt.stream.streamer import LayerStreamer

    with pytest.raises(StreamConfigError):
        LayerStreamer(StreamConfig.uniform(0, 1024))


def test_streamer_says_there_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CuPy cannot be imported (as on a machine without CUDA) the refusal says what is missing."""
    from kvrt.stream.streamer import LayerStreamer, NoGpuError

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(NoGpuError, match="needs CuPy and a CUDA GPU"):
        LayerStreamer(StreamConfig.uniform(2, 1024))


class _FakeCuda:
    """A synchronous stand-in for the slice of CuPy the streamer calls, recording every call.

    It proves the executor's wiring on any machine (the plan's ops in order on the right
    streams, copies from the right pool offsets into the right slots, work called with
    the compute stream current); GPU semantics are the GPU tests' job.
    """

    def __init__(self) -> None:
        import ctypes
        import types

        self.log: list[tuple] = []
        self.current = None
        fake = self

        class Pinned(bytearray):
            @property
            def ptr(self) -> int:
                return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

        class Slot(np.ndarray):
            @property
            def data(self):  # CuPy's MemoryPointer: .ptr
                return types.SimpleNamespace(ptr=self.ctypes.data)

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                assert non_blocking
                self.ptr = 1000 + len(fake.streams)
                fake.streams.append(self)

            def wait_event(self, event) -> None:
                fake.log.append(("wait", self.ptr, event.tag))

            def __enter__(self):
                fake.current = self

            def __exit__(self, *exc) -> None:
                fake.current = None

        class Event:
            def __init__(self) -> None:
                self.tag = None

            def record(self, stream) -> None:
                fake.log.append(("record", stream.ptr, self.tag))

            def synchronize(self) -> None:
                fake.log.append(("host-wait", self.tag))

        def memcpy(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
            assert kind == 1
            fake.log.append(("copy", stream, dst, src, nbytes))
            ctypes.memmove(dst, src, nbytes)

        self.streams: list = []
        self.uint8 = np.uint8
        self.empty = lambda n, dtype: np.zeros(n, dtype).view(Slot)
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=lambda: (1 << 30, 1 << 30),
                                          memcpyAsync=memcpy, memcpyHostToDevice=1,
                                          CUDARuntimeError=RuntimeError),
            alloc_pinned_memory=Pinned, Stream=Stream, Event=Event, get_elapsed_time=lambda a, b: 1.0,
            Device=lambda: types.SimpleNamespace(synchronize=lambda: fake.log.append(("device-sync",))))


@pytest.mark.parametrize("overlapped", [False, True])
def test_streamer_executes_its_plan_op_by_op(monkeypatch: pytest.MonkeyPatch, overlapped: bool) -> None:
    from kvrt.stream.streamer import LayerStreamer
    from kvrt.stream.streamplan import Stream

    fake = _FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    config = StreamConfig((5000, 3, 4096, 7), slot_bytes=5000)
    streamer = LayerStreamer(config)
    for name, events in streamer._events.items():
        for i, event in enumerate(events):
            event.tag = (name, i)
    for i in range(config.n_layers):
        streamer.host_layer(i)[:] = np.arange(config.layer_bytes[i]) * (i + 1) % 251
    seen = []

    def work(layer: int, slot) -> None:
        assert fake.current is streamer.compute_stream
        seen.append(layer)
        np.testing.assert_array_equal(slot, streamer.host_layer(layer))  # the copy landed (synchronously here)

    times = streamer.run(work, overlapped=overlapped)
    assert seen == list(range(config.n_layers))
    assert times.total_ms == 1.0 and len(times.transfer_ms) == config.n_layers
    ptr = {s: streamer._streams[s].ptr for s in Stream}
    expected: list[tuple] = [("device-sync",)]
    for op in plan(config.n_layers, overlapped=overlapped):
        if op.kind is Kind.RECORD:
            expected.append(("record", ptr[op.stream], (op.event, op.layer)))
        elif op.kind is Kind.WAIT:
            expected.append(("wait", ptr[op.stream], (op.event, op.layer)))
        elif op.kind is Kind.COPY:
            expected.append(("copy", ptr[Stream.TRANSFER], streamer.slot(op.slot).ctypes.data,
                             streamer._pinned.ptr + config.offsets[op.layer], config.layer_bytes[op.layer]))
    expected.append(("host-wait", ("compute_end", config.n_layers - 1)))
    assert fake.log == expected  # and no other host wait anywhere in the pass


def times(transfer: list[float], compute: list[float], total: float) -> RunTimes:
    return RunTimes(tuple(transfer), tuple(compute), total)


def test_report_ratios_for_a_balanced_run() -> None:
    n, mib = 16, 1 << 20
    serial = times([1.0] * n, [1.0] * n, 2.0 * n)
    overlapped = times([1.05] * n, [1.0] * n, n + 1.5)
    transfer_only = times([1.0] * n, [0.0] * n, 0.95 * n)
    r = report(serial, overlapped, transfer_only, [64 * mib] * n)
    assert r.speedup == pytest.approx(32 / 17.5)
    assert r.savings == pytest.approx(1 - 17.5 / 32)
    assert r.ideal_speedup == pytest.approx(2.0)
    assert r.pipeline_ideal_speedup == pytest.approx(32 / 17)
    assert r.efficiency == pytest.approx(r.speedup / 2)
    assert r.pipeline_efficiency == pytest.approx(17 / 17.5)
    assert r.h2d_gbps == pytest.approx(64 * mib / 1.05e6)
    assert r.h2d_fraction == pytest.approx(0.95 / 1.05)


def test_headline_has_the_seeds_exact_format() -> None:
    r = report(times([2.0], [1.0], 3.0), times([2.0], [1.0], 2.5), times([2.0], [0.0], 2.0), [1 << 20])
    assert r.headline() == "HEADLINE: serial=3.00 ms, overlapped=2.50 ms, savings=16.67%, speedup=1.200x"
    assert "ideal=1.500x" in r.detail() and "efficiency=0.800" in r.detail()


# --- on the GPU -----------------------------------------------------------------------------------

def fma_expected(layers: list[np.ndarray], iters: int) -> np.ndarray:
    """float64 sum over layers of the FMA chain seeded by each float32 weight."""
    from kvrt.kernels.layer import FMA_DECAY

    total = np.zeros(layers[0].size // 4)
    for blob in layers:
        w = blob.view(np.float32).astype(np.float64)
        acc = w.copy()
        for _ in range(iters):
            acc = acc * float(FMA_DECAY) + w
        total += acc
    return total


@pytest.fixture
def fma_streamer():
    """Six 4 MiB layers of random float32 in the pinned pool."""
    from kvrt.stream.streamer import LayerStreamer

    streamer = LayerStreamer(StreamConfig.uniform(6, 4 << 20))
    rng = np.random.default_rng()
    for i in range(streamer.config.n_layers):
        streamer.host_layer(i).view(np.float32)[:] = rng.uniform(-1, 1, (4 << 20) // 4)
    yield streamer
    streamer.close()


def fma_pass(streamer, *, overlapped: bool, iters: int, poison: bool) -> np.ndarray:
    import cupy as cp

    from kvrt.stream.streamwork import FmaWork

    fma = FmaWork(cp, streamer.config.layer_bytes[0], iters)

    def work(layer: int, slot) -> None:
        fma(layer, slot)
        if poison:  # on the compute stream, after the read: a copy that does not wait for it gets clobbered
            slot.fill(0xFF)  # float32 NaN

    fma.reset()
    times = streamer.run(work, overlapped=overlapped)
    assert len(times.transfer_ms) == len(times.compute_ms) == streamer.config.n_layers
    return fma.result().get()


@pytest.mark.gpu
@pytest.mark.parametrize("poison", [False, True])
def test_serial_and_overlapped_fma_passes_are_identical_and_right(fma_streamer, poison: bool) -> None:
    layers = [fma_streamer.host_layer(i) for i in range(fma_streamer.config.n_layers)]
    expected = fma_expected(layers, 24)
    serial = fma_pass(fma_streamer, overlapped=False, iters=24, poison=poison)
    for _ in range(3):  # the same pinned pool and slots, pass after pass
        overlapped = fma_pass(fma_streamer, overlapped=True, iters=24, poison=poison)
        np.testing.assert_array_equal(overlapped, serial)
    np.testing.assert_allclose(serial, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_real_layers_streamed_match_numpy_float32() -> None:
    import cupy as cp

    from kvrt.stream.layer import ArrayOps, LayerShape, fill_random, forward, rope_tables, weights
    from kvrt.stream.streamer import LayerStreamer
    from kvrt.stream.streamwork import LayerWork

    shape = LayerShape(n_embd=256, n_head=4, n_head_kv=2, n_ff=512)
    tokens, n_layers = 24, 4
    with LayerStreamer(StreamConfig.uniform(n_layers, shape.nbytes)) as streamer:
        for i in range(n_layers):
            fill_random(streamer.host_layer(i), shape, seed=100 + i, xp=np)
        work = LayerWork(cp, shape, tokens, seed=7, tile=10)
        work.reset()
        streamer.run(work, overlapped=False)
        serial = work.result().get()
        work.reset()
        streamer.run(work, overlapped=True)
        overlapped = work.result().get()
        layers = [streamer.host_layer(i).copy() for i in range(n_layers)]
        x = work.x0.get()
    np.testing.assert_array_equal(overlapped, serial)
    ops = ArrayOps(np, np.float32)
    rope = rope_tables(ops, np.arange(tokens), shape)
    for blob in layers:
        x = forward(ops, x, weights(blob, shape), shape, rope)
    scale = float(np.abs(x).max())
    np.testing.assert_allclose(serial, x, rtol=3e-2, atol=3e-2 * scale)
