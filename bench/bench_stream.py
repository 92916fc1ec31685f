"""Microbenchmarks of the layer streamer's fixed costs: building a plan, the pool-to-slot copy, a slot swap.

The headline ratios come from ``kvrt bench stream``; these isolate what every layer
pays on top of its copy and compute. Run: ``pytest bench/bench_stream.py --benchmark-enable``.
"""

from __future__ import annotations

import pytest

from kvrt.stream.streamplan import StreamConfig, plan, simulate


def noop(layer: int, slot: object) -> None:
    """Work that enqueues nothing: a pass then costs only copies, events and waits."""


def test_plan_for_64_layers(benchmark) -> None:
    """Host cost of deciding a 64-layer overlapped pass (paid once per pass)."""
    ops = benchmark(plan, 64, overlapped=True)
    assert len(ops) == 64 * 7 + 62


def test_simulate_64_layers(benchmark) -> None:
    ops = plan(64, overlapped=True)
    intervals = benchmark(simulate, ops, [1.0] * 64, [1.0] * 64)
    assert len(intervals) == 128


@pytest.fixture(scope="module")
def streamer_factory():
    """Streamers closed at module end; skips with the streamer's own reason where there is no GPU
    (tests/conftest.py's ``gpu``-marker skip does not reach bench/)."""
    from kvrt.stream.streamer import LayerStreamer, NoGpuError

    made = []

    def make(n_layers: int, nbytes: int) -> LayerStreamer:
        try:
            made.append(LayerStreamer(StreamConfig.uniform(n_layers, nbytes)))
        except NoGpuError as exc:
            pytest.skip(str(exc))
        return made[-1]

    yield make
    for streamer in made:
        streamer.close()


@pytest.mark.gpu
def test_pool_to_slot_copy_64mib(benchmark, streamer_factory) -> None:
    """One 64 MiB layer from the pinned pool into a device slot, waited for (the seed's per-layer copy)."""
    streamer = streamer_factory(1, 64 << 20)
    times = benchmark(streamer.run, noop, overlapped=True)
    assert times.transfer_ms[0] > 0


@pytest.mark.gpu
def test_slot_swap_16_tiny_layers(benchmark, streamer_factory) -> None:
    """An overlapped pass over 16 layers of 4 KiB: per-layer event, wait and copy-enqueue overhead."""
    streamer = streamer_factory(16, 4096)
    times = benchmark(streamer.run, noop, overlapped=True)
    assert len(times.transfer_ms) == 16
