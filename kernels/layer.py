"""Numba CUDA kernels for one streamed layer: the seed's FMA cost pass, RMSNorm and SiLU-gate.

These are the pieces of a layer's work that CuPy does not give as one fused pass (the
GEMMs go to cuBLAS through CuPy). Every kernel computes in float32 whatever its
storage type, casts with ``np.float32``/``np.float16`` (which both Numba's simulator
and numba-cuda type), and runs unchanged under ``NUMBA_ENABLE_CUDASIM=1``.

The launch helpers take NumPy arrays (simulator), Numba device arrays, or anything
with ``__cuda_array_interface__`` (CuPy). The latter are wrapped with ``sync=False``:
CuPy exports its current stream in the interface and Numba would otherwise block the
host on that stream at every launch, which would serialise the streamer's pipeline.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

THREADS = 256          # threads per block for the elementwise kernels
NORM_THREADS = 256     # threads per row in RMSNorm; a power of two (tree reduction)
MAX_BLOCKS = 65535     # grid-stride loops cover any size with at most this many blocks

FMA_DECAY = np.float32(0.9990234375)  # exactly representable; keeps the chain bounded (|acc| <= 1024 |w|)


def _device(array: Any) -> Any:
    """A kernel argument for ``array`` that never synchronises the host (see module doc)."""
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is None:
        return array
    return cuda.from_cuda_array_interface(interface, owner=array, sync=False)


_external: dict[int, Any] = {}


def external_stream(ptr: int) -> Any:
    """Numba's handle for a CUDA stream created elsewhere (CuPy's), cached per pointer; 0 is the default stream."""
    if ptr == 0:
        return 0
    if ptr not in _external:
        _external[ptr] = cuda.external_stream(ptr)
    return _external[ptr]


def _grid(n: int) -> int:
    return max(1, min(math.ceil(n / THREADS), MAX_BLOCKS))


@cuda.jit
def _fma_passes(weights, out, iters):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, weights.size, stride):
        w = np.float32(weights[i])
        acc = w
        for _ in range(iters):
            acc = acc * FMA_DECAY + w
        out[i] += acc


def fma_passes(weights: Any, out: Any, iters: int, stream: Any = 0) -> None:
    """``out[i] += a(iters)`` where ``a`` runs ``iters`` dependent FMAs seeded by ``weights[i]``.

    The seed's per-layer cost kernel: its cost scales with the layer's size times
    ``iters``, and accumulating into ``out`` makes every layer's weights reach the result
    (so the compiler cannot drop the work and a test can see any layer read too early).
    """
    if weights.shape != out.shape or weights.ndim != 1:
        raise ValueError(f"fma_passes needs 1-D weights and out of one shape, got {weights.shape} and {out.shape}")
    if iters < 0:
        raise ValueError(f"fma_passes needs iters >= 0, got {iters}")
    _fma_passes[_grid(weights.size), THREADS, stream](_device(weights), _device(out), iters)


@cuda.jit
def _rms_norm(x, weight, eps, out):
    partial = cuda.shared.array(NORM_THREADS, np.float32)
    tid = cuda.threadIdx.x
    cols = x.shape[1]
    inv_cols = np.float32(1.0) / np.float32(cols)
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        acc = np.float32(0.0)
        for j in range(tid, cols, NORM_THREADS):
            v = np.float32(x[row, j])
            acc += v * v
        partial[tid] = acc
        cuda.syncthreads()
        step = NORM_THREADS // 2
        while step > 0:
            if tid < step:
                partial[tid] += partial[tid + step]
            cuda.syncthreads()
            step //= 2
        scale = np.float32(1.0) / math.sqrt(partial[0] * inv_cols + np.float32(eps))
        for j in range(tid, cols, NORM_THREADS):
            out[row, j] = np.float32(x[row, j]) * scale * np.float32(weight[j])
        cuda.syncthreads()  # partial[0] is read above before the next row overwrites it


def rms_norm(x: Any, weight: Any, eps: float, out: Any, stream: Any = 0) -> None:
    """``out[r] = x[r] / sqrt(mean(x[r]**2) + eps) * weight``, one block per row, float32 inside.

    ``out`` may be float16 (the input of the next GEMM) while ``x`` is the float32
    residual stream: the cast is fused into the store.
    """
    if x.ndim != 2 or out.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm needs x (rows, cols), weight (cols,), out like x; got "
                         f"{x.shape}, {weight.shape}, {out.shape}")
    blocks = max(1, min(x.shape[0], MAX_BLOCKS))
    _rms_norm[blocks, NORM_THREADS, stream](_device(x), _device(weight), float(eps), _device(out))


@cuda.jit
def _silu_gate(gate_up, out):
    width = out.shape[1]
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, out.size, stride):
        row = i // width
        col = i - row * width
        g = np.float32(gate_up[row, col])
        u = np.float32(gate_up[row, width + col])
        out[row, col] = g / (np.float32(1.0) + math.exp(-g)) * u


def silu_gate(gate_up: Any, out: Any, stream: Any = 0) -> None:
    """``out = silu(gate) * up`` where ``gate_up`` is ``[gate | up]`` from one fused GEMM.

    Fusing the gate and up projections into one GEMM (weights side by side) halves the
    GEMM launches and lets this kernel read both halves of each row in one pass.
    """
    if gate_up.ndim != 2 or out.ndim != 2 or gate_up.shape != (out.shape[0], 2 * out.shape[1]):
        raise ValueError(f"silu_gate needs gate_up (rows, 2*width) and out (rows, width); got "
                         f"{gate_up.shape} and {out.shape}")
    _silu_gate[_grid(out.size), THREADS, stream](_device(gate_up), _device(out))
