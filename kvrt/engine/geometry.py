"""The dimensions of a llama-style transformer that its KV memory and compute follow.

One type for the whole of kvrt: a GGUF's header as the estimate reads it
(:class:`kvrt.accounting.estimate.ModelShape`) and a generated test model's spec
(:class:`kvrt.modelfiles.testmodels.Shape`) are both a :class:`ModelGeometry` with
fields of their own, and per-head sizes, KV bytes per token and the grouped-query ratio
are computed here only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrt.checks import check_int
from kvrt.errors import InvalidArgument

KV_BYTES_PER_ELEMENT = 2
"""llama.cpp's default KV cache type, F16, for K and V alike."""


@dataclass(frozen=True)
class ModelGeometry:
    """Layer count, widths, heads and vocabulary; per-head K/V lengths default to ``n_embd // n_head``.

    Invariants: every count is positive (``n_vocab`` may be 0 where a header lists no
    tokens), and ``n_head`` is a multiple of ``n_head_kv`` (grouped-query attention).
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    key_length: int = 0
    value_length: int = 0

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv"):
            check_int(getattr(self, name), f"{kind}.{name}", low=1, noun="a positive integer")
        check_int(self.n_vocab, f"{kind}.n_vocab", low=0)
        if self.n_head % self.n_head_kv:
            raise InvalidArgument(f"{kind}: n_head ({self.n_head}) is not a multiple of n_head_kv ({self.n_head_kv})")
        for name in ("key_length", "value_length"):
            if check_int(getattr(self, name), f"{kind}.{name}", low=0) == 0:
                object.__setattr__(self, name, self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of one layer's K (or V) projection: the KV heads times the head size."""
        return self.n_head_kv * self.head_dim

    def kv_bytes_per_token(self, bytes_per_element: int = KV_BYTES_PER_ELEMENT) -> int:
        """K and V of one token in every layer."""
        return self.n_layer * self.n_head_kv * (self.key_length + self.value_length) * bytes_per_element
