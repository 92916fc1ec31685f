"""The peer a user would pick instead of kvrt: llama-cpp-python's high-level ``Llama`` with its prompt cache.

Same GGUF, same machine, same token ids as kvrt's arms, greedy (temperature 0, repeat
penalty 1: llama-cpp-python's sampler chain then ends in llama.cpp's greedy sampler),
flash attention as given (off by default on both sides, for exact tokens), the same
``n_batch`` / ``n_ubatch`` / threads, ``swa_full`` as kvrt's contexts. What the peer does
on its own, as shipped: ``create_completion`` looks the prompt up in the cache
(``LlamaRAMCache`` or ``LlamaDiskCache``), loads the whole-context state on a longer
cached prefix than the live context holds, reuses the live context's matching prefix
(``kv_cache_seq_rm`` past it) and evaluates the rest, and after every completion saves
the whole state (KV plus its ``n_batch x n_vocab`` logits array) into the cache. Its
contexts are its own: one ``llama_context`` per ``Llama``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHES = ("ram", "disk")


@dataclass(frozen=True)
class GreedyReference:
    """Greedy tokens of one from-scratch ``Llama`` evaluation and, at every sampled step, its top-two logit margin."""

    tokens: list[int]
    margins: list[float]


def greedy_reference(llm: Any, segments: Sequence[Sequence[int]], prompt: Sequence[int],
                     max_tokens: int) -> GreedyReference:
    """Evaluate ``segments`` one ``Llama.eval`` each after a reset, then let ``Llama.generate`` continue greedily
    with ``prompt`` for at most ``max_tokens`` (an end-of-generation token ends it and is not kept)."""
    import llama_cpp
    import numpy as np

    llm.reset()  # the next eval clears the cache from position 0
    history: list[int] = []
    for segment in segments:
        llm.eval(list(segment))
        history += segment
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    tokens: list[int] = []
    margins: list[float] = []
    steps = llm.generate(history + list(prompt), temp=0.0)
    for token in steps:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        top = np.partition(logits, -2)[-2:]
        margins.append(float(top[1] - top[0]))
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    steps.close()
    return GreedyReference(tokens, margins)


@dataclass(frozen=True)
class PeerCompletion:
    """One completion: its text, when its first token arrived and when it ended (ms from the call)."""

    text: str
    first_token_ms: float
    total_ms: float


class LlamaPeer:
    """One ``llama_cpp.Llama`` over ``path`` with a context of ``n_ctx`` cells and a prompt cache."""

    def __init__(self, path: str | os.PathLike[str], *, n_ctx: int, n_batch: int = 512, n_threads: int | None = None,
                 n_gpu_layers: int = -1, flash_attn: bool = False) -> None:
        from llama_cpp import Llama

        threads = n_threads or os.cpu_count() or 1
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512),
                         n_threads=threads, n_threads_batch=threads, n_gpu_layers=n_gpu_layers,
                         flash_attn=flash_attn, swa_full=True, verbose=False)
        self._disk = Path(tempfile.mkdtemp(prefix="kvrt-peer-cache-"))
        self._disk_uses = 0
        self.cache_kind: str | None = None

    def empty_cache(self, kind: str, capacity_bytes: int = 2 << 30) -> None:
        """A new, empty cache of ``kind`` and an empty live context: nothing of earlier prompts is reused."""
        from llama_cpp import LlamaDiskCache, LlamaRAMCache

        if kind not in CACHES:
            raise ValueError(f"peer cache {kind!r}: choose one of {CACHES}")
        shutil.rmtree(self._disk, ignore_errors=True)
        self._disk.mkdir(parents=True, exist_ok=True)
        if kind == "ram":
            cache: Any = LlamaRAMCache(capacity_bytes=capacity_bytes)
        else:
            self._disk_uses += 1
            cache = LlamaDiskCache(cache_dir=str(self._disk / f"c{self._disk_uses}"), capacity_bytes=capacity_bytes)
        self.llm.set_cache(cache)
        self.llm.reset()
        self.cache_kind = kind

    def complete(self, tokens: Sequence[int], max_tokens: int) -> PeerCompletion:
        """Greedy completion of ``tokens`` (ids, used as given: no BOS added), streamed to time the first token."""
        t0 = time.perf_counter()
        first: float | None = None
        pieces: list[str] = []
        for chunk in self.llm.create_completion(list(tokens), max_tokens=max_tokens, temperature=0.0,
                                                repeat_penalty=1.0, stream=True):
            if first is None:
                first = time.perf_counter()
            pieces.append(chunk["choices"][0]["text"])
        end = time.perf_counter()
        return PeerCompletion("".join(pieces), ((first or end) - t0) * 1e3, (end - t0) * 1e3)

    def state_bytes(self) -> int:
        """Bytes of the live context's whole state (what one cache entry's KV part holds)."""
        import llama_cpp

        return int(llama_cpp.llama_state_get_size(self.llm.ctx))

    def close(self) -> None:
        self.llm.set_cache(None)
        self.llm.close()
        shutil.rmtree(self._disk, ignore_errors=True)

    def __enter__(self) -> LlamaPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
