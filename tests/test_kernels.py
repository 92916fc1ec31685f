"""kvrt.kernels.layer against NumPy float64 references (the CUDA simulator on CPU, the GPU where there is one).

Inputs are fresh random arrays per example; outputs start poisoned with NaN so a
kernel that leaves any element unwritten fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.kernels import layer as kl

SMALL = settings(max_examples=6, deadline=None)


def fma_reference(weights: np.ndarray, out: np.ndarray, iters: int) -> np.ndarray:
    w = weights.astype(np.float64)
    acc = w.copy()
    for _ in range(iters):
        acc = acc * float(kl.FMA_DECAY) + w
    return out.astype(np.float64) + acc


def rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * weight.astype(np.float64)


def silu_gate_reference(gate_up: np.ndarray) -> np.ndarray:
    g, u = np.split(gate_up.astype(np.float64), 2, axis=1)
    return g / (1.0 + np.exp(-g)) * u


@SMALL
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 700), iters=st.integers(0, 40))
def test_fma_passes_matches_float64(seed: int, n: int, iters: int) -> None:
    rng = np.random.default_rng(seed)
    weights = rng.uniform(-1, 1, n).astype(np.float32)
    out = rng.uniform(-1, 1, n).astype(np.float32)
    expected = fma_reference(weights, out, iters)
    kl.fma_passes(weights, out, iters)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * (iters + 1))


@SMALL
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), cols=st.integers(1, 600),
       out_dtype=st.sampled_from([np.float32, np.float16]))
def test_rms_norm_matches_float64(seed: int, rows: int, cols: int, out_dtype: type) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (rows, cols)).astype(np.float32)
    weight = rng.normal(1, 0.1, cols).astype(np.float16)
    out = np.full((rows, cols), np.nan, dtype=out_dtype)
    kl.rms_norm(x, weight, 1e-6, out)
    tol = 2e-3 if out_dtype is np.float16 else 1e-5
    np.testing.assert_allclose(out, rms_norm_reference(x, weight, 1e-6), rtol=tol, atol=tol)


@SMALL
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), width=st.integers(1, 300),
       dtype=st.sampled_from([np.float32, np.float16]))
def test_silu_gate_matches_float64(seed: int, rows: int, width: int, dtype: type) -> None:
    rng = np.random.default_rng(seed)
    gate_up = rng.normal(0, 4, (rows, 2 * width)).astype(dtype)
    out = np.full((rows, width), np.nan, dtype=dtype)
    kl.silu_gate(gate_up, out)
    tol = 4e-3 if dtype is np.float16 else 1e-5
    np.testing.assert_allclose(out, silu_gate_reference(gate_up), rtol=tol, atol=tol)


def test_rms_norm_spans_rows_with_fewer_blocks_than_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid-stride row loop (more rows than blocks) reuses shared memory correctly."""
    monkeypatch.setattr(kl, "MAX_BLOCKS", 2)
    rng = np.random.default_rng()
    x = rng.normal(0, 1, (5, 33)).astype(np.float32)
    weight = np.ones(33, np.float32)
    out = np.full_like(x, np.nan)
    kl.rms_norm(x, weight, 1e-5, out)
    np.testing.assert_allclose(out, rms_norm_reference(x, weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call", [
    lambda: kl.fma_passes(np.zeros(4, np.float32), np.zeros(5, np.float32), 1),
    lambda: kl.fma_passes(np.zeros(4, np.float32), np.zeros(4, np.float32), -1),
    lambda: kl.rms_norm(np.zeros((2, 4), np.float32), np.zeros(3, np.float32), 1e-6, np.zeros((2, 4), np.float32)),
    lambda: kl.silu_gate(np.zeros((2, 5), np.float32), np.zeros((2, 2), np.float32)),
])
def test_shape_mismatches_are_refused_before_launch(call) -> None:
    with pytest.raises(ValueError):
        call()


def test_importing_the_kernels_leaves_numpy_as_it_was(monkeypatch):
    """The numba-cuda bridge for NumPy 2.5 (no ``row_stack``) must not leave the alias behind."""
    import numpy

    import kvrt.kernels

    monkeypatch.delattr(numpy, "row_stack", raising=False)  # as on NumPy >= 2.5
    kvrt.kernels._import_numba_cuda_arrayobj()
    assert not hasattr(numpy, "row_stack")
