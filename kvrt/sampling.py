"""Sampler chains: greedy, or temperature with top-k / top-p / min-p and a seed."""

from __future__ import annotations

from dataclasses import dataclass

from kvrt.bindings import ffi, lib
from kvrt.context import Context
from kvrt.errors import DecodeError, KvrtError
from kvrt._handle import NativeHandle, OwnsHandle


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; ``temperature <= 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise KvrtError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise KvrtError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise KvrtError(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.seed < 2**32:
            raise KvrtError(f"seed must fit in 32 bits, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler(OwnsHandle):
    """A llama.cpp sampler chain built from :class:`SamplingParams` (one per sequence)."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params or SamplingParams()
        chain = lib().llama_sampler_chain_init(lib().llama_sampler_chain_default_params())
        if chain == ffi.NULL:
            raise KvrtError("llama_sampler_chain_init returned NULL")
        self._handle = NativeHandle(chain, lib().llama_sampler_free, "sampler")
        p = self.params
        if p.greedy:
            stages = [lib().llama_sampler_init_greedy()]
        else:
            stages = [
                lib().llama_sampler_init_top_k(p.top_k),
                lib().llama_sampler_init_top_p(p.top_p, 1),
                lib().llama_sampler_init_min_p(p.min_p, 1),
                lib().llama_sampler_init_temp(p.temperature),
                lib().llama_sampler_init_dist(p.seed),
            ]
        for stage in stages:
            if stage == ffi.NULL:
                raise KvrtError(f"llama.cpp could not create a sampler stage for {p}")
            lib().llama_sampler_chain_add(chain, stage)  # the chain now owns the stage

    def sample(self, ctx: Context, row: int) -> int:
        """Pick the next token from the logits of batch row ``row`` and accept it."""
        if not ctx.has_logits(row):
            # llama_sampler_sample asserts (aborts the process) on a row without logits.
            raise DecodeError("llama_sampler_sample", "no logits were computed for this row", row=row)
        return int(lib().llama_sampler_sample(self.ptr, ctx.ptr, row))

    def reset(self) -> None:
        lib().llama_sampler_reset(self.ptr)

