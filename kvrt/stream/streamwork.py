"""The two kinds of per-layer work the streamer is measured with: the seed's FMA pass and a real layer.

Each is a :data:`kvrt.stream.streamer.Work` callable with the state it carries from layer to
layer, plus ``reset`` (start a pass from the same input) and ``result``. Both make
every layer's bytes reach the result, so a layer read before its copy finished, or
a slot overwritten while read, changes the output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvrt.kernels import layer as kl
from kvrt.stream.layer import KernelOps, LayerShape, forward, rope_tables, weights
from kvrt.stream.streamplan import StreamConfigError


class FmaWork:
    """The seed's cost model: ``compute_iters`` FMAs over every float32 of the layer, summed into one output."""

    def __init__(self, cp: Any, bytes_per_layer: int, compute_iters: int) -> None:
        if bytes_per_layer % 4:
            raise StreamConfigError(f"FMA mode reads the layer as float32; {bytes_per_layer} bytes is not a "
                                    "multiple of 4")
        self._cp = cp
        self.compute_iters = compute_iters
        self.out = cp.zeros(bytes_per_layer // 4, dtype=cp.float32)

    def reset(self) -> None:
        self.out.fill(0)

    def __call__(self, layer: int, slot: Any) -> None:
        stream = kl.external_stream(self._cp.cuda.get_current_stream().ptr)
        kl.fma_passes(slot.view(self._cp.float32), self.out, self.compute_iters, stream)

    def result(self) -> Any:
        return self.out


class LayerWork:
    """A prefill chunk of ``tokens`` tokens through each streamed layer (see :mod:`kvrt.stream.layer`)."""

    def __init__(self, cp: Any, shape: LayerShape, tokens: int, seed: int = 0, tile: int = 1024) -> None:
        self.shape = shape
        self.tile = tile
        self.ops = KernelOps(cp, np.float16)
        rng = cp.random.default_rng(seed)
        self.x0 = rng.standard_normal((tokens, shape.n_embd), dtype=cp.float32)
        self.rope = rope_tables(self.ops, cp.arange(tokens), shape)
        self.x = self.x0

    def reset(self) -> None:
        self.x = self.x0.copy()

    def __call__(self, layer: int, slot: Any) -> None:
        self.x = forward(self.ops, self.x, weights(slot, self.shape), self.shape, self.rope, self.tile)

    def result(self) -> Any:
        return self.x
