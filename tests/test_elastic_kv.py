"""ElasticKV and its kernels against NumPy float64, across page boundaries (simulator on CPU, CUDA on GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvrt.memory.elastic import ElasticError, ElasticPool
from kvrt.memory.elastic_kv import ElasticKV, KVLayout
from kvrt.memory.vmm import HostDriver

PAGE = 4096


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, group: int) -> np.ndarray:
    """float64 softmax(q k^T / sqrt(d)) v per head, head h reading KV head h // group."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    out = np.empty_like(q)
    for h in range(q.shape[0]):
        scores = k[:, h // group, :] @ q[h] / math.sqrt(q.shape[1])
        weights = np.exp(scores - scores.max())
        out[h] = weights @ v[:, h // group, :] / weights.sum()
    return out


class Host:
    """Array namespace and pool for the CPU run."""

    xp = np

    @staticmethod
    def pool() -> ElasticPool:
        return ElasticPool(HostDriver(PAGE), map_ahead_stripes=0)

    @staticmethod
    def get(a):
        return np.asarray(a)


class Cuda:
    @property
    def xp(self):
        import cupy

        return cupy

    @staticmethod
    def pool() -> ElasticPool:
        return ElasticPool(map_ahead_stripes=1)

    @staticmethod
    def get(a):
        return a.get()


def run_appends_and_attention(env, layout: KVLayout, chunks: list[int], n_head: int) -> None:
    xp = env.xp
    rng = np.random.default_rng(1)
    pool = env.pool()
    kv = ElasticKV(pool, "m", layout)
    truth_k = [np.zeros((0, layout.n_kv_heads, layout.head_dim), np.float16) for _ in range(layout.n_layer)]
    truth_v = [t.copy() for t in truth_k]
    per_page = pool.page_bytes // layout.token_bytes
    for t in chunks:
        start = kv.reserve(t)
        assert kv.tenant.committed_bytes == -(-kv.n_tokens // per_page) * pool.page_bytes
        for layer in range(layout.n_layer):
            k_new = rng.standard_normal((t, layout.n_kv_heads, layout.head_dim)).astype(np.float16)
            v_new = rng.standard_normal((t, layout.n_kv_heads, layout.head_dim)).astype(np.float16)
            kv.append(layer, start, xp.asarray(k_new), xp.asarray(v_new))
            truth_k[layer] = np.concatenate([truth_k[layer], k_new])
            truth_v[layer] = np.concatenate([truth_v[layer], v_new])
            q = rng.standard_normal((n_head, layout.head_dim)).astype(np.float32)
            out = xp.zeros((n_head, layout.head_dim), dtype=np.float32)
            kv.attend(layer, xp.asarray(q), out)
            expected = reference_attention(q, truth_k[layer], truth_v[layer], n_head // layout.n_kv_heads)
            np.testing.assert_allclose(env.get(out), expected, rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(env.get(kv.keys(layer)[: kv.n_tokens]), truth_k[layer])
    # give most back, then grow again past the old length: the reused prefix still holds its data
    keep = chunks[0]
    fence = pool.driver.fence()  # after every kernel above; waited so the unmap below is not deferred
    fence.wait()
    kv.truncate(keep, fence)
    pool.maintain()
    assert kv.tenant.mapped_bytes <= -(-keep // per_page) * pool.page_bytes * 2 * layout.n_layer
    start = kv.reserve(per_page + 3)
    k_new = rng.standard_normal((per_page + 3, layout.n_kv_heads, layout.head_dim)).astype(np.float16)
    kv.append(0, start, xp.asarray(k_new), xp.asarray(k_new))
    q = rng.standard_normal((n_head, layout.head_dim)).astype(np.float32)
    out = xp.zeros((n_head, layout.head_dim), dtype=np.float32)
    kv.attend(0, xp.asarray(q), out)
    k_all = np.concatenate([truth_k[0][:keep], k_new])
    v_all = np.concatenate([truth_v[0][:keep], k_new])
    np.testing.assert_allclose(env.get(out), reference_attention(q, k_all, v_all, n_head // layout.n_kv_heads),
                               rtol=1e-4, atol=1e-5)
    kv.close()
    pool.check()
    pool.close()


def test_append_and_decode_attention_cross_page_boundaries_on_host():
    layout = KVLayout(n_layer=2, n_kv_heads=2, head_dim=16, max_tokens=512)  # 64 tokens per 4 KiB page
    run_appends_and_attention(Host(), layout, [5, 58, 1, 70, 66], n_head=4)


def test_mha_single_token_chunks():
    layout = KVLayout(n_layer=1, n_kv_heads=2, head_dim=32, max_tokens=256)  # 32 tokens per page
    run_appends_and_attention(Host(), layout, [1, 31, 1, 1, 33], n_head=2)


def test_misuse_is_refused_before_any_kernel_runs():
    pool = Host.pool()
    kv = ElasticKV(pool, "m", KVLayout(n_layer=1, n_kv_heads=2, head_dim=16, max_tokens=128))
    k = np.zeros((4, 2, 16), np.float16)
    with pytest.raises(ElasticError, match="reserve first"):
        kv.append(0, 0, k, k)
    kv.reserve(4)
    with pytest.raises(ElasticError, match="float16"):
        kv.append(0, 0, k.astype(np.float32), k)
    with pytest.raises(ElasticError, match="layer 3"):
        kv.append(3, 0, k, k)
    with pytest.raises(ElasticError, match="exceed max_tokens"):
        kv.reserve(125)
    with pytest.raises(ElasticError, match="head_dim"):
        kv.attend(0, np.zeros((3, 16), np.float32), np.zeros((3, 16), np.float32))
    with pytest.raises(ElasticError, match="exceeds the attention kernel"):
        KVLayout(n_layer=1, n_kv_heads=1, head_dim=512, max_tokens=8)
    pool.close()


@pytest.mark.gpu
def test_append_and_decode_attention_on_the_gpu():
    # Llama-3.2-1B's KV geometry: 8 KV heads x 64 dims -> 1 KiB per token, 2048 tokens per 2 MiB page
    layout = KVLayout(n_layer=2, n_kv_heads=8, head_dim=64, max_tokens=16384)
    run_appends_and_attention(Cuda(), layout, [100, 1948, 1, 2100, 7], n_head=32)
