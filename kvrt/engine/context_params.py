"""The parameters of a llama.cpp context: a frozen record, every field checked before llama.cpp sees it.

Apart from the context itself (:mod:`kvrt.engine.context`): configs, pools, stagers and
estimates pass these around long before (or without) a context being made.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from kvrt.bindings import FLASH_ATTN, lib
from kvrt.checks import INT32_MAX, check_int, shown
from kvrt.errors import InvalidArgument

_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class ContextParams:
    """The context parameters kvrt sets; everything else keeps llama.cpp's default.

    ``n_ctx`` counts token cells of the whole context. With ``kv_unified`` all
    sequences draw on one pool of cells (what prefix sharing needs); without it each of
    the ``n_seq_max`` sequences gets ``n_ctx / n_seq_max`` cells of its own. llama.cpp
    rounds ``n_ctx`` up to a multiple of 256: :attr:`kvrt.engine.context.Context.n_ctx` is the real size.

    ``backend_sampling`` lets :meth:`kvrt.engine.context.Context.sample_on_device` put llama.cpp's greedy sampler
    into the decode's graph for chosen sequences (llama.cpp's backend sampling): their rows' picks come back as
    token ids, and no row of logits is copied out for them. It caps a batch's outputs at ``n_seq_max``: llama.cpp
    sizes its sampling buffers (three vocabulary-wide rows an output) by that cap, and aborts the process on a
    batch past it, so :meth:`kvrt.engine.context.Context.decode` refuses one first.
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = False
    n_threads: int | None = None
    flash_attn: str = "auto"
    offload_kqv: bool = True
    swa_full: bool = True
    backend_sampling: bool = False

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):  # uint32_t in llama_context_params
            check_int(getattr(self, name), f"ContextParams.{name}", low=1, high=_UINT32_MAX,
                      noun="a positive integer")
        if self.n_ubatch > self.n_batch:
            raise InvalidArgument(f"n_ubatch ({self.n_ubatch}) cannot exceed n_batch ({self.n_batch})")
        if not isinstance(self.flash_attn, str) or self.flash_attn not in FLASH_ATTN:
            raise InvalidArgument(f"ContextParams.flash_attn must be one of {sorted(FLASH_ATTN)}, "
                                  f"got {shown(self.flash_attn)}")
        if self.n_threads is not None:  # int32_t
            check_int(self.n_threads, "ContextParams.n_threads", low=1, high=INT32_MAX, noun="a positive integer")
        for name in ("kv_unified", "offload_kqv", "swa_full", "backend_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"ContextParams.{name} must be True or False, got {shown(getattr(self, name))}")

    @property
    def threads(self) -> int:
        return self.n_threads or os.cpu_count() or 1

    def to_c(self) -> Any:
        params = lib().llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_ubatch
        params.n_seq_max = self.n_seq_max
        params.kv_unified = self.kv_unified
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.flash_attn_type = FLASH_ATTN[self.flash_attn]
        params.offload_kqv = self.offload_kqv
        params.swa_full = self.swa_full
        if self.backend_sampling:
            params.n_outputs_max = self.n_seq_max
            params.n_outputs_max_per_seq = 1
        return params

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
