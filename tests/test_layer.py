"""kvrt.stream.layer: the real-layer math the streamer runs, checked on CPU.

The NumPy float32 path (the GPU test's reference) against float64; the kernel path
(Numba kernels under the simulator, fp16 GEMM inputs like the GPU) against float64;
attention against a per-head loop written independently; the blob layout.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.stream.layer import (
    ALIGN,
    ArrayOps,
    KernelOps,
    LayerShape,
    attention,
    fill_random,
    forward,
    rope_tables,
    weights,
)

SMALL = LayerShape(n_embd=64, n_head=4, n_head_kv=2, n_ff=96, rope_base=10000.0)


def layer_inputs(shape: LayerShape, tokens: int, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    blob = np.zeros(shape.nbytes, np.uint8)
    fill_random(blob, shape, seed, np)
    x = np.random.default_rng(seed + 1).normal(0, 1, (tokens, shape.n_embd)).astype(np.float32)
    return x, weights(blob, shape), np.arange(tokens)


def run(ops: ArrayOps, x: np.ndarray, w: dict[str, np.ndarray], positions: np.ndarray, tile: int = 1024) -> np.ndarray:
    return forward(ops, x.astype(ops.acc), w, SMALL, rope_tables(ops, positions, SMALL), tile)


def naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    tokens, n_head, dim = q.shape
    group = n_head // k.shape[1]
    out = np.zeros((tokens, n_head, dim))
    for h in range(n_head):
        for i in range(tokens):
            s = np.array([q[i, h] @ k[j, h // group] for j in range(i + 1)]) / math.sqrt(dim)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[: i + 1, h // group]
    return out.reshape(tokens, n_head * dim)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), tokens=st.integers(1, 9), tile=st.integers(1, 10))
def test_attention_matches_a_per_head_loop(seed: int, tokens: int, tile: int) -> None:
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 1, (tokens, 4, 8))
    k, v = rng.normal(0, 1, (2, tokens, 2, 8))
    got = attention(ArrayOps(np, np.float64), q, k, v, tile)
    np.testing.assert_allclose(got, naive_attention(q, k, v), rtol=1e-12, atol=1e-12)


def test_float32_reference_matches_float64() -> None:
    x, w, pos = layer_inputs(SMALL, 11, seed=np.random.default_rng().integers(2**31))
    ref = run(ArrayOps(np, np.float64), x, w, pos)
    got = run(ArrayOps(np, np.float32), x, w, pos, tile=4)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("act", "tol"), [(np.float32, 1e-4), (np.float16, 3e-2)])
def test_kernel_path_matches_float64(act: type, tol: float) -> None:
    """The GPU's code path (kernels for RMSNorm and SiLU-gate), simulated, fp16 GEMM inputs included."""
    x, w, pos = layer_inputs(SMALL, 5, seed=np.random.default_rng().integers(2**31))
    ref = run(ArrayOps(np, np.float64), x, w, pos)
    got = run(KernelOps(np, act), x, w, pos)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_earlier_tokens_do_not_see_later_ones() -> None:
    x, w, pos = layer_inputs(SMALL, 8, seed=3)
    changed = x.copy()
    changed[5:] += 1.0
    ops = ArrayOps(np, np.float64)
    np.testing.assert_array_equal(run(ops, x, w, pos)[:5], run(ops, changed, w, pos)[:5])


def test_qwen_layout_is_the_issues_466_mb_and_aligned() -> None:
    shape = LayerShape.preset("qwen2.5-7b")
    assert 466_000_000 < shape.nbytes < 466_300_000
    spans = sorted((offset, offset + math.prod(dims) * 2) for offset, dims in shape.layout().values())
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] == shape.nbytes


def test_weights_are_views_of_the_blob() -> None:
    blob = np.zeros(SMALL.nbytes, np.uint8)
    w = weights(blob, SMALL)
    w["w_down"][...] = 1.0
    assert np.shares_memory(w["w_down"], blob) and blob.any()
