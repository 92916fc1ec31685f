"""Numba CUDA kernels over a contiguous (virtually) KV cache: append and single-token decode attention.

The cache of one layer is a plain ``(max_tokens, n_kv_heads, head_dim)`` fp16 array
whose first tokens are backed by physical pages (:class:`kvrt.memory.elastic_kv.ElasticKV`):
the kernels index it directly, with no page table, and must only touch the tokens
that were reserved. Both run under ``NUMBA_ENABLE_CUDASIM=1`` for the CPU tests.
"""

from __future__ import annotations

import math

from numba import cuda, float32

MAX_HEAD_DIM = 256  # one thread per head dimension; shared tiles are sized for this
APPEND_THREADS = 256


@cuda.jit
def kv_append(cache, new, start):
    """``cache[start + i] = new[i]`` for the ``new.shape[0]`` tokens; ``cache`` and ``new`` are 2-D (tokens, row)."""
    i = cuda.grid(1)
    row = new.shape[1]
    if i < new.shape[0] * row:
        t = i // row
        c = i - t * row
        cache[start + t, c] = new[t, c]


@cuda.jit
def decode_attention(q, k, v, n_ctx, group, scale, out):
    """Softmax attention of one query token per head over cache positions ``[0, n_ctx)``.

    ``q`` and ``out`` are ``(n_head, head_dim)`` float32; ``k``/``v`` are
    ``(max_tokens, n_kv_heads, head_dim)`` fp16; query head ``h`` reads KV head
    ``h // group`` (grouped-query attention). One block per query head and one thread
    per head dimension: each tile of ``head_dim`` tokens is scored one token per
    thread, then every thread folds the tile into its output dimension with an online
    softmax (running max and sum), in float32.
    """
    h = cuda.blockIdx.x
    d = cuda.threadIdx.x
    hd = q.shape[1]
    kvh = h // group
    qs = cuda.shared.array(MAX_HEAD_DIM, float32)
    scores = cuda.shared.array(MAX_HEAD_DIM, float32)
    qs[d] = q[h, d] * scale
    cuda.syncthreads()
    running_max = float32(-math.inf)
    total = float32(0.0)
    acc = float32(0.0)
    for tile in range(0, n_ctx, hd):
        j = tile + d
        if j < n_ctx:
            s = float32(0.0)
            for c in range(hd):
                s += qs[c] * float32(k[j, kvh, c])
            scores[d] = s
        cuda.syncthreads()
        count = min(hd, n_ctx - tile)
        for jj in range(count):
            s = scores[jj]
            new_max = max(running_max, s)
            correction = math.exp(running_max - new_max)
            p = math.exp(s - new_max)
            total = total * correction + p
            acc = acc * correction + p * float32(v[tile + jj, kvh, d])
            running_max = new_max
        cuda.syncthreads()
    out[h, d] = acc / total
