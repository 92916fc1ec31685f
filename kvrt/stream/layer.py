"""One transformer layer's prefill over a chunk of B tokens, written once for NumPy and CuPy.

The streamer's real-layer mode streams a layer's weights as one fp16 blob (the
layout below) and runs :func:`forward` over the device slot; the tests run the very
same function with NumPy to get the float32 and float64 references. What differs
between the two is only an :class:`ArrayOps` (which array module, which dtype the
GEMMs see, and whether RMSNorm / SiLU-gate are Numba kernels or plain array math).

The layer is a Qwen2/Llama block: RMSNorm, fused QKV projection, RoPE (NeoX halves),
causal grouped-query softmax attention, output projection, residual; RMSNorm, fused
gate|up projection, SiLU-gate, down projection, residual. Simplified, and said so in
reports: attention covers the chunk only (the chunk is the whole prompt, no earlier
KV cache), it materialises each query tile's scores (no flash attention), and
Qwen2's small q/k/v biases are left out. The residual stream stays float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvrt.engine.geometry import ModelGeometry

ALIGN = 256  # byte alignment of each tensor inside the layer blob (cuBLAS/vector-load friendly)
WEIGHT_DTYPE = np.float16


@dataclass(frozen=True, kw_only=True)
class LayerShape(ModelGeometry):
    """One transformer layer's geometry (``n_layer`` 1, no vocabulary) and what its compute needs besides."""

    n_layer: int = 1
    n_vocab: int = 0
    n_ff: int
    rope_base: float = 10000.0
    eps: float = 1e-6

    @classmethod
    def preset(cls, name: str) -> LayerShape:
        """A layer of one of :mod:`kvrt.modelfiles.testmodels`' shapes."""
        from kvrt.modelfiles.testmodels import PRESETS  # noqa: PLC0415

        s = PRESETS[name]
        return cls(n_embd=s.n_embd, n_head=s.n_head, n_head_kv=s.n_head_kv, n_ff=s.n_ff, rope_base=s.rope_freq_base)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every weight; matrices are (in, out) so a GEMM is ``x @ w``."""
        e, kv, ff = self.n_embd, self.kv_dim, self.n_ff
        return {"attn_norm": (e,), "wqkv": (e, e + 2 * kv), "wo": (e, e),
                "ffn_norm": (e,), "w_gate_up": (e, 2 * ff), "w_down": (ff, e)}

    def layout(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Name -> (byte offset, shape) inside one layer's blob."""
        layout, at = {}, 0
        for name, shape in self.tensors().items():
            layout[name] = (at, shape)
            at += -(-math.prod(shape) * WEIGHT_DTYPE().itemsize // ALIGN) * ALIGN
        return layout

    @property
    def nbytes(self) -> int:
        offset, shape = list(self.layout().values())[-1]
        return offset + math.prod(shape) * WEIGHT_DTYPE().itemsize

    def flops(self, tokens: int) -> int:
        """GEMM floating-point operations of one layer over ``tokens`` tokens (causal attention halved)."""
        matrix_params = sum(math.prod(s) for s in self.tensors().values() if len(s) == 2)
        attention = 2 * 2 * self.n_head * self.head_dim * tokens * (tokens + 1) // 2
        return 2 * matrix_params * tokens + attention


def weights(blob: Any, shape: LayerShape) -> dict[str, Any]:
    """Views of a layer's fp16 tensors over its blob (a uint8 NumPy or CuPy array); no copies."""
    views = {}
    for name, (offset, dims) in shape.layout().items():
        nbytes = math.prod(dims) * WEIGHT_DTYPE().itemsize
        views[name] = blob[offset:offset + nbytes].view(WEIGHT_DTYPE).reshape(dims)
    return views


def fill_random(blob: Any, shape: LayerShape, seed: int, xp: ModuleType) -> None:
    """Random weights into ``blob``: matrices ~ N(0, 1/fan_in) (activations stay O(1)), norms ~ 1."""
    rng = xp.random.default_rng(seed)
    for view in weights(blob, shape).values():
        values = rng.standard_normal(view.shape, dtype=xp.float32)
        view[...] = 1.0 + 0.1 * values if view.ndim == 1 else values / math.sqrt(view.shape[0])


class ArrayOps:
    """Plain array math in ``act`` precision: the reference (NumPy float32/float64)."""

    def __init__(self, xp: ModuleType, act: Any) -> None:
        self.xp = xp
        self.act = np.dtype(act)
        self.acc = np.dtype(np.float64 if self.act == np.float64 else np.float32)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        x = x.astype(self.acc)
        scale = 1.0 / self.xp.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
        return (x * scale * weight.astype(self.acc)).astype(self.act)

    def silu_gate(self, gate_up: Any) -> Any:
        g, u = self.xp.split(gate_up.astype(self.acc), 2, axis=1)
        return (g / (1.0 + self.xp.exp(-g)) * u).astype(self.act)


class KernelOps(ArrayOps):
    """RMSNorm and SiLU-gate through :mod:`kvrt.kernels.layer`, on CuPy's current stream.

    With NumPy as ``xp`` the kernels run under the CUDA simulator (tests on CPU); with
    CuPy they are launched on the stream CuPy is using, so they queue behind the
    GEMMs of the same layer on the streamer's compute stream.
    """

    def _stream(self) -> Any:
        if self.xp is np:
            return 0
        from kvrt.kernels.layer import external_stream  # noqa: PLC0415

        return external_stream(self.xp.cuda.get_current_stream().ptr)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        from kvrt.kernels import layer as kl  # noqa: PLC0415

        out = self.xp.empty(x.shape, dtype=self.act)
        kl.rms_norm(x, weight, eps, out, self._stream())
        return out

    def silu_gate(self, gate_up: Any) -> Any:
        from kvrt.kernels import layer as kl  # noqa: PLC0415

        out = self.xp.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=self.act)
        kl.silu_gate(gate_up, out, self._stream())
        return out


def rope_tables(ops: ArrayOps, positions: Any, shape: LayerShape) -> tuple[Any, Any]:
    """cos and sin, ``(tokens, head_dim / 2)`` in ``ops.act``, for NeoX-style rotation."""
    xp, half = ops.xp, shape.head_dim // 2
    inv_freq = shape.rope_base ** (-xp.arange(half, dtype=xp.float64) / half)
    angles = positions.astype(xp.float64)[:, None] * inv_freq[None, :]
    return xp.cos(angles).astype(ops.act), xp.sin(angles).astype(ops.act)


def _rope(xp: ModuleType, x: Any, cos: Any, sin: Any) -> Any:
    """Rotate the two halves of each head of ``x`` (tokens, heads, head_dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention(ops: ArrayOps, q: Any, k: Any, v: Any, tile: int) -> Any:
    """Causal grouped-query softmax attention over the chunk; q (B, H, D), k and v (B, Hkv, D).

    Query tiles of ``tile`` rows bound the scores buffer to (H, tile, B); the softmax
    runs in ``ops.acc`` precision, the two GEMMs in ``ops.act``.
    """
    xp = ops.xp
    tokens, n_head, dim = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    q = xp.ascontiguousarray((q * (1.0 / math.sqrt(dim))).astype(ops.act)
                             .reshape(tokens, n_kv, group, dim).transpose(1, 2, 0, 3))  # (Hkv, G, B, D)
    k = xp.ascontiguousarray(k.transpose(1, 2, 0))  # (Hkv, D, B)
    v = xp.ascontiguousarray(v.transpose(1, 0, 2))  # (Hkv, B, D)
    out = xp.empty((n_kv, group, tokens, dim), dtype=ops.act)
    keys = xp.arange(tokens)
    for start in range(0, tokens, tile):
        end = min(start + tile, tokens)
        scores = (q[:, :, start:end] @ k[:, None, :, :end]).astype(ops.acc)  # (Hkv, G, t, end)
        future = keys[None, :end] > xp.arange(start, end)[:, None]
        scores = xp.where(future, -xp.inf, scores)
        scores = xp.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = (scores / scores.sum(axis=-1, keepdims=True)).astype(ops.act)
        out[:, :, start:end] = probs @ v[:, None, :end]
    return out.transpose(2, 0, 1, 3).reshape(tokens, n_head * dim)


def forward(ops: ArrayOps, x: Any, w: dict[str, Any], shape: LayerShape, rope: tuple[Any, Any],
            tile: int = 1024) -> Any:
    """The layer over residual stream ``x`` (B, n_embd) in ``ops.acc``; returns the new residual stream.

    ``w`` holds the layer's tensors (fp16 views of a slot, or upcast copies for a
    reference); each GEMM runs in ``ops.act`` with the weights in that dtype.
    """
    xp, act = ops.xp, ops.act
    tokens, e, kv = x.shape[0], shape.n_embd, shape.kv_dim
    cast = {name: t if t.dtype == act else t.astype(act) for name, t in w.items()}
    h = ops.rms_norm(x, cast["attn_norm"], shape.eps)
    qkv = h @ cast["wqkv"]
    q = _rope(xp, qkv[:, :e].reshape(tokens, shape.n_head, shape.head_dim), *rope)
    k = _rope(xp, qkv[:, e:e + kv].reshape(tokens, shape.n_head_kv, shape.head_dim), *rope)
    v = qkv[:, e + kv:].reshape(tokens, shape.n_head_kv, shape.head_dim)
    x = x + (attention(ops, q, k, v, tile) @ cast["wo"]).astype(ops.acc)
    h = ops.rms_norm(x, cast["ffn_norm"], shape.eps)
    return x + (ops.silu_gate(h @ cast["w_gate_up"]) @ cast["w_down"]).astype(ops.acc)
