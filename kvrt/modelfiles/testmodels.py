"""Deterministic llama-architecture GGUF files with random weights, for tests and benchmarks.

The weights are random, so the text these models write is noise; what they are good for
is exactness (the same bytes every time, so logits can be compared bit for bit) and
cost (prefill and state sizes depend on shape and type, not on the weights' values).
Every preset is labelled in its GGUF ``general.name`` as random weights of its shape.

The vocabulary is a byte-level SentencePiece one: the 256 byte tokens are written as
``<0x00>``..``<0xFF>`` with token type BYTE, which is what llama.cpp's loader needs.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvrt.engine.geometry import ModelGeometry

BYTE_TOKEN_TYPE = 6
NORMAL, UNKNOWN, CONTROL, UNUSED = 1, 2, 3, 5
_TILE_THRESHOLD = 1 << 22


@dataclass(frozen=True, kw_only=True)
class Shape(ModelGeometry):
    """A llama-architecture test model's geometry and how to write it; ``label`` says whose shape it copies."""

    label: str
    n_ff: int
    n_ctx_train: int
    rope_freq_base: float = 10000.0
    dtype: str = "f32"
    """``f32``, ``f16`` or ``q4_0`` (matrices quantized; norms stay F32)."""

    def weight_bytes(self) -> int:
        per_layer = 2 * self.n_embd * self.n_embd + 2 * self.kv_dim * self.n_embd + 3 * self.n_ff * self.n_embd
        return int(_BYTES_PER_WEIGHT[self.dtype] * (2 * self.n_vocab * self.n_embd + self.n_layer * per_layer))


_BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "q4_0": 18 / 32}  # Q4_0: 32 weights in 16 bytes + an F16 scale


PRESETS: dict[str, Shape] = {
    "tiny": Shape(label="tiny test model", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                  n_vocab=512, n_ctx_train=65536, dtype="f32"),
    "llama3.2-1b": Shape(label="Llama-3.2-1B shape", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192,
                         n_vocab=128256, n_ctx_train=131072, rope_freq_base=500000.0, dtype="f16"),
    # Q4_0 matrices whose sides are multiples of 32: eligible for llama.cpp's CPU extra buffer types
    # (AMX, repacked weights), which :mod:`kvrt.modelfiles.cpu_probe` probes with this preset.
    "probe-q4_0": Shape(label="extra buffer type probe", n_layer=1, n_embd=256, n_head=4, n_head_kv=4, n_ff=512,
                        n_vocab=512, n_ctx_train=4096, dtype="q4_0"),
    "probe-wide-vocab": Shape(label="host-overhead probe: Qwen2.5's vocabulary, almost no compute", n_layer=1,
                              n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=152064, n_ctx_train=65536,
                              dtype="f32"),
    "qwen2.5-7b": Shape(label="Qwen2.5-7B shape", n_layer=28, n_embd=3584, n_head=28, n_head_kv=4, n_ff=18944,
                        n_vocab=152064, n_ctx_train=32768, rope_freq_base=1000000.0, dtype="f16"),
}


def vocabulary(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of a byte-level SPM vocabulary of exactly ``n_vocab`` entries.

    Special tokens, the 256 byte tokens, the word-boundary marker and printable ASCII
    (with and without the marker) so ordinary text tokenizes compactly; the rest are
    ``<unusedN>`` fillers that pad the vocabulary to a real model's size.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [UNKNOWN, CONTROL, CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE_TOKEN_TYPE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(33, 127)] + ["\u2581" + chr(c) for c in range(33, 127)]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab must be at least {len(tokens)}, got {n_vocab}")
    fill = n_vocab - len(tokens)
    tokens += [f"<unused{i}>" for i in range(fill)]
    types += [UNUSED] * fill
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(len(p)) for p in pieces] + [-1e6] * fill
    return tokens, scores, types


def _tensor_specs(shape: Shape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape (rows = output features), is_norm) in the order llama.cpp expects."""
    e, kv, ff = shape.n_embd, shape.kv_dim, shape.n_ff
    specs: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (shape.n_vocab, e), False)]
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        specs += [
            (b + "attn_norm.weight", (e,), True),
            (b + "attn_q.weight", (e, e), False),
            (b + "attn_k.weight", (kv, e), False),
            (b + "attn_v.weight", (kv, e), False),
            (b + "attn_output.weight", (e, e), False),
            (b + "ffn_norm.weight", (e,), True),
            (b + "ffn_gate.weight", (ff, e), False),
            (b + "ffn_up.weight", (ff, e), False),
            (b + "ffn_down.weight", (e, ff), False),
        ]
    specs += [("output_norm.weight", (e,), True), ("output.weight", (shape.n_vocab, e), False)]
    return specs


class _Weights:
    """Random weights, reproducible per (seed, tensor name).

    Large tensors are tiled from one random block with a per-name offset: the values
    do not matter for what large presets measure, and this keeps a 15 GB write fast.
    """

    def __init__(self, seed: int, dtype: np.dtype) -> None:
        self.seed = seed
        self.dtype = dtype
        self._block: np.ndarray | None = None

    def __call__(self, name: str, dims: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(dims))
        scale = 1.0 / np.sqrt(dims[-1])
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        if n <= _TILE_THRESHOLD:
            small: np.ndarray = (rng.standard_normal(n) * scale).astype(self.dtype).reshape(dims)
            return small
        if self._block is None:
            self._block = np.random.default_rng(self.seed).standard_normal(_TILE_THRESHOLD + 4099).astype(np.float32)
        start = int(rng.integers(0, 4099))
        reps = -(-n // _TILE_THRESHOLD)
        flat = np.tile(self._block[start:start + _TILE_THRESHOLD], reps)[:n]
        tiled: np.ndarray = (flat * scale).astype(self.dtype).reshape(dims)
        return tiled


def write_model(
    path: str | Path,
    preset: str | Shape = "tiny",
    *,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write the GGUF for ``preset`` to ``path`` (atomically) and return the path; ``chat_template`` (Jinja
    source) becomes its ``tokenizer.chat_template``."""
    import gguf

    shape = PRESETS[preset] if isinstance(preset, str) else preset
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    dtype = np.dtype(np.float16 if shape.dtype == "f16" else np.float32)
    quant = gguf.GGMLQuantizationType.Q4_0 if shape.dtype == "q4_0" else None
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"kvrt random weights, {shape.label}")
    writer.add_description(f"random weights (seed {seed}) with the shape of {shape.label}; not a trained model")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type({"f32": 0, "f16": 1, "q4_0": 2}[shape.dtype])  # llama_ftype ALL_F32 / MOSTLY_F16 / MOSTLY_Q4_0
    tokens, scores, types = vocabulary(shape.n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    specs = _tensor_specs(shape)
    weights = _Weights(seed, dtype)

    def tensor(name: str, dims: tuple[int, ...], is_norm: bool) -> np.ndarray:
        if is_norm:
            return np.ones(dims, dtype=np.float32)
        data = weights(name, dims)
        return data if quant is None else gguf.quants.quantize(data, quant)

    for name, dims, is_norm in specs:
        if quant is None or is_norm:
            tdtype = np.dtype(np.float32) if is_norm else dtype
            writer.add_tensor_info(name, dims, tdtype, int(np.prod(dims)) * tdtype.itemsize)
        else:
            rows, cols = dims
            nbytes = rows * (cols // 32) * 18
            writer.add_tensor_info(name, (rows, cols // 32 * 18), np.dtype(np.uint8), nbytes, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, dims, is_norm) in enumerate(specs):
        writer.write_tensor_data(tensor(name, dims, is_norm))
        if progress is not None:
            progress(i + 1, len(specs))
    writer.close()
    tmp.replace(path)
    return path


def ensure_model(directory: str | Path, preset: str = "tiny", *, seed: int = 0) -> Path:
    """The preset's file in ``directory``, written on first use."""
    path = Path(directory) / f"kvrt-{preset}-seed{seed}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, preset, seed=seed)
    return path
