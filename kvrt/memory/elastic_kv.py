"""A KV cache for custom runtimes on the elastic pool: per-layer K and V, backed as tokens arrive.

One :class:`ElasticKV` is one pool tenant with ``2 * n_layer`` segments (K of layer 0,
V of layer 0, K of layer 1, ...). Each segment is a ``(max_tokens, n_kv_heads,
head_dim)`` fp16 array over a contiguous virtual range, so the kernels in
:mod:`kvrt.kernels.kv` index tokens directly; only the first ``n_tokens`` (rounded up to
a page) are backed by physical memory. ``reserve`` maps pages for new tokens before
anything writes them; ``truncate`` hands pages back (after a fence, see
:mod:`kvrt.memory.elastic`).

On the GPU the arrays are CuPy; on a CPU machine with :class:`kvrt.memory.vmm.HostDriver`
they are NumPy and the kernels run under Numba's CUDA simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrt.memory.elastic import ElasticError, ElasticPool
from kvrt.memory.vmm import Fence

KV_DTYPE = np.float16


@dataclass(frozen=True)
class KVLayout:
    """The geometry of one model's KV cache."""

    n_layer: int
    n_kv_heads: int
    head_dim: int
    max_tokens: int

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_kv_heads", "head_dim", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ElasticError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        from kvrt.kernels.kv import MAX_HEAD_DIM

        if self.head_dim > MAX_HEAD_DIM:
            raise ElasticError(f"head_dim {self.head_dim} exceeds the attention kernel's {MAX_HEAD_DIM}")

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one segment (K or V of one layer)."""
        return self.n_kv_heads * self.head_dim * np.dtype(KV_DTYPE).itemsize

    @property
    def segment_bytes(self) -> int:
        return self.max_tokens * self.token_bytes

    def kv_bytes(self, n_tokens: int) -> int:
        """K and V of ``n_tokens`` in every layer: what a static cache of that length holds."""
        return 2 * self.n_layer * n_tokens * self.token_bytes


class ElasticKV:
    """Per-layer K/V of one sequence stream on an :class:`ElasticPool` (see the module docstring)."""

    def __init__(self, pool: ElasticPool, name: str, layout: KVLayout) -> None:
        self.pool = pool
        self.layout = layout
        self.tenant = pool.add_tenant(name, layout.segment_bytes, segments=2 * layout.n_layer)
        shape = (layout.max_tokens, layout.n_kv_heads, layout.head_dim)
        self._k = [self.tenant.view(2 * i, shape, KV_DTYPE) for i in range(layout.n_layer)]
        self._v = [self.tenant.view(2 * i + 1, shape, KV_DTYPE) for i in range(layout.n_layer)]
        self.n_tokens = 0

    @property
    def name(self) -> str:
        return self.tenant.name

    @property
    def capacity_tokens(self) -> int:
        """Tokens the mapped pages hold without growing."""
        return min(self.tenant.committed_bytes // self.layout.token_bytes, self.layout.max_tokens)

    @property
    def mapped_bytes(self) -> int:
        return self.tenant.mapped_bytes

    def keys(self, layer: int) -> Any:
        self._check_layer(layer)
        return self._k[layer]

    def values(self, layer: int) -> Any:
        self._check_layer(layer)
        return self._v[layer]

    def reserve(self, n_new: int) -> int:
        """Back ``n_new`` more positions in every layer; returns the first.

        Raises :class:`kvrt.memory.elastic.ElasticRefusal` when the pool cannot supply the pages.
        """
        if n_new <= 0:
            raise ElasticError(f"{self.name}: reserve needs a positive token count, got {n_new}")
        total = self.n_tokens + n_new
        if total > self.layout.max_tokens:
            raise ElasticError(f"{self.name}: {self.n_tokens} + {n_new} tokens exceed max_tokens "
                               f"{self.layout.max_tokens}")
        self.tenant.grow_to(total * self.layout.token_bytes)
        start, self.n_tokens = self.n_tokens, total
        return start

    def truncate(self, n_tokens: int, fence: Fence | None = None) -> None:
        """Keep positions ``[0, n_tokens)``; pages above return to the pool once ``fence`` is done.

        No kernel may be launched on the dropped positions after this call.
        """
        if not 0 <= n_tokens <= self.n_tokens:
            raise ElasticError(f"{self.name}: cannot truncate {self.n_tokens} tokens to {n_tokens}")
        self.n_tokens = n_tokens
        self.tenant.shrink_to(n_tokens * self.layout.token_bytes, fence)

    def append(self, layer: int, start: int, k_new: Any, v_new: Any) -> None:
        """Write ``(t, n_kv_heads, head_dim)`` fp16 K and V at positions ``[start, start + t)`` of ``layer``."""
        from kvrt.kernels.kv import APPEND_THREADS, kv_append

        self._check_layer(layer)
        expect = (self.layout.n_kv_heads, self.layout.head_dim)
        for what, arr in (("k", k_new), ("v", v_new)):
            if arr.ndim != 3 or tuple(arr.shape[1:]) != expect or arr.dtype != KV_DTYPE:
                raise ElasticError(f"{self.name}: {what} must be (t, {expect[0]}, {expect[1]}) float16, "
                                   f"got {tuple(arr.shape)} {arr.dtype}")
        t = int(k_new.shape[0])
        if v_new.shape[0] != t or t == 0:
            raise ElasticError(f"{self.name}: k has {t} tokens, v {int(v_new.shape[0])}; need the same, > 0")
        if start < 0 or start + t > self.n_tokens:
            raise ElasticError(f"{self.name}: positions [{start}, {start + t}) are outside the "
                               f"{self.n_tokens} reserved tokens (reserve first)")
        row = expect[0] * expect[1]
        blocks = math.ceil(t * row / APPEND_THREADS)
        for cache, new in ((self._k[layer], k_new), (self._v[layer], v_new)):
            kv_append[blocks, APPEND_THREADS](cache.reshape(self.layout.max_tokens, row), new.reshape(t, row), start)

    def attend(self, layer: int, q: Any, out: Any, n_ctx: int | None = None) -> Any:
        """Decode attention of one token: ``q`` and ``out`` are ``(n_head, head_dim)`` float32; reads ``[0, n_ctx)``."""
        from kvrt.kernels.kv import decode_attention

        self._check_layer(layer)
        n_ctx = self.n_tokens if n_ctx is None else n_ctx
        if not 0 < n_ctx <= self.n_tokens:
            raise ElasticError(f"{self.name}: attention over {n_ctx} tokens, but {self.n_tokens} are reserved")
        n_head, hd = (int(x) for x in q.shape)
        if hd != self.layout.head_dim or n_head % self.layout.n_kv_heads or tuple(out.shape) != (n_head, hd):
            raise ElasticError(f"{self.name}: q {tuple(q.shape)} / out {tuple(out.shape)} do not fit head_dim "
                               f"{self.layout.head_dim} with {self.layout.n_kv_heads} KV heads")
        group = n_head // self.layout.n_kv_heads
        scale = np.float32(1.0 / math.sqrt(hd))
        decode_attention[n_head, hd](q, self._k[layer], self._v[layer], n_ctx, group, scale, out)
        return out

    def close(self, fence: Fence | None = None) -> None:
        self._k.clear()
        self._v.clear()
        self.tenant.close(fence)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.n_layer:
            raise ElasticError(f"{self.name}: layer {layer} is outside [0, {self.layout.n_layer})")

    def __repr__(self) -> str:
        return f"ElasticKV({self.name!r}, {self.n_tokens} tokens, {self.mapped_bytes} B mapped)"
