"""A loaded llama.cpp model: its handle, vocabulary and identity.

A :class:`Model` owns one ``llama_model *``. Contexts made from it are tracked so
that closing the model first closes them (llama.cpp would otherwise free a model
under a live context). Its :class:`ModelFingerprint` is what snapshots compare
before any state bytes reach llama.cpp.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrt.bindings import capture, explain, ffi, lib
from kvrt.errors import KvrtError, ModelLoadError
from kvrt._handle import NativeHandle, OwnsHandle

if TYPE_CHECKING:
    from kvrt.context import Context

GGUF_MAGIC = b"GGUF"
_IDENTITY_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelFingerprint:
    """Identity of a model file plus the architecture numbers that shape its KV state.

    ``content`` hashes the file's size, first and last MiB: cheap, and it changes when
    the file is replaced even if the path does not.
    """

    content: str
    description: str
    n_layer: int
    n_embd: int
    n_head_kv: int
    n_vocab: int

    def mismatch(self, other: ModelFingerprint) -> str | None:
        """A sentence naming the first difference, or ``None`` when they agree."""
        for field in ("content", "description", "n_layer", "n_embd", "n_head_kv", "n_vocab"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"{field} differs: {mine!r} != {theirs!r}"
        return None


def _file_identity(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with path.open("rb") as fh:
        digest.update(fh.read(_IDENTITY_BYTES))
        if size > _IDENTITY_BYTES:
            fh.seek(max(size - _IDENTITY_BYTES, _IDENTITY_BYTES))
            digest.update(fh.read(_IDENTITY_BYTES))
    return digest.hexdigest()


def _check_file(path: Path) -> None:
    """Refuse what llama.cpp would only log about, before handing it the path."""
    if not path.exists():
        raise ModelLoadError("llama_model_load_from_file", "no such file", path=str(path))
    if not path.is_file():
        raise ModelLoadError("llama_model_load_from_file", "not a regular file", path=str(path))
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            "llama_model_load_from_file", f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})", path=str(path)
        )


class Model(OwnsHandle):
    """A llama.cpp model, loaded from a GGUF file or borrowed from llama-cpp-python.

    ``n_gpu_layers=-1`` offloads every layer to the GPU when llama.cpp has one and is a
    no-op on a CPU build. ``progress`` receives load progress in [0, 1].
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int = -1,
        use_mmap: bool = True,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self.path = Path(path).resolve()
        _check_file(self.path)
        params = lib().llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        if not use_mmap:
            params.load_mode = 0  # LLAMA_LOAD_MODE_NONE; the default lets llama.cpp pick
        keep_alive: Any = None
        if progress is not None:

            def on_progress(fraction: float, _user: Any) -> bool:
                progress(fraction)
                return True

            keep_alive = ffi.callback("bool(float, void *)", on_progress)
            params.progress_callback = keep_alive
        with capture() as lines:
            ptr = lib().llama_model_load_from_file(str(self.path).encode(), params)
        del keep_alive
        if ptr == ffi.NULL:
            raise ModelLoadError(
                "llama_model_load_from_file", explain(lines, "llama.cpp could not load the model"), path=str(self.path)
            )
        self._handle = NativeHandle(ptr, lib().llama_model_free, f"model {self.path.name}")
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        self._fingerprint: ModelFingerprint | None = None

    @classmethod
    def from_llama_cpp(cls, llm: Any) -> Model:
        """Borrow the model of a ``llama_cpp.Llama`` (it stays owned by ``llm``)."""
        import ctypes

        address = ctypes.cast(llm.model, ctypes.c_void_p).value
        if not address:
            raise KvrtError("the llama_cpp.Llama holds no model (was it closed?)")
        self = cls.__new__(cls)
        self.path = Path(llm.model_path).resolve()
        self._handle = NativeHandle(ffi.cast("struct llama_model *", address), lib().llama_model_free,
                                    f"model {self.path.name}", borrowed=True)
        self._contexts = weakref.WeakSet()
        self._fingerprint = None
        return self

    # -- lifetime -------------------------------------------------------------------
    def _adopt(self, context: Context) -> None:
        self._contexts.add(context)

    def close(self) -> None:
        """Free the model, closing every context made from it first."""
        for context in list(self._contexts):
            context.close()
        super().close()

    # -- architecture -----------------------------------------------------------------
    @property
    def vocab(self) -> Any:
        return lib().llama_model_get_vocab(self.ptr)

    @property
    def n_layer(self) -> int:
        return int(lib().llama_model_n_layer(self.ptr))

    @property
    def n_embd(self) -> int:
        return int(lib().llama_model_n_embd(self.ptr))

    @property
    def n_head(self) -> int:
        return int(lib().llama_model_n_head(self.ptr))

    @property
    def n_head_kv(self) -> int:
        return int(lib().llama_model_n_head_kv(self.ptr))

    @property
    def n_ctx_train(self) -> int:
        return int(lib().llama_model_n_ctx_train(self.ptr))

    @property
    def n_vocab(self) -> int:
        return int(lib().llama_vocab_n_tokens(self.vocab))

    @property
    def size_bytes(self) -> int:
        """Bytes of all weight tensors, as llama.cpp counts them."""
        return int(lib().llama_model_size(self.ptr))

    @property
    def n_params(self) -> int:
        return int(lib().llama_model_n_params(self.ptr))

    @property
    def description(self) -> str:
        buf = ffi.new("char[]", 256)
        n = lib().llama_model_desc(self.ptr, buf, 256)
        return ffi.string(buf).decode("utf-8", "replace") if n >= 0 else ""

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or ``None`` when the key is absent."""
        size = 1024
        while True:
            buf = ffi.new("char[]", size)
            n = lib().llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return ffi.string(buf).decode("utf-8", "replace")
            size = n + 1

    @property
    def fingerprint(self) -> ModelFingerprint:
        if self._fingerprint is None:
            self._fingerprint = ModelFingerprint(
                content=_file_identity(self.path),
                description=self.description,
                n_layer=self.n_layer,
                n_embd=self.n_embd,
                n_head_kv=self.n_head_kv,
                n_vocab=self.n_vocab,
            )
        return self._fingerprint

    # -- vocabulary -------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (with BOS when the model asks for it and ``add_special``)."""
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = ffi.new("llama_token[]", capacity)
        n = lib().llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            if n == -(2**31):
                raise ModelLoadError("llama_tokenize", "token count overflows int32", n_bytes=len(data))
            capacity = -n
            buf = ffi.new("llama_token[]", capacity)
            n = lib().llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
            if n < 0:
                raise ModelLoadError("llama_tokenize", "tokenization failed", code=n, n_bytes=len(data))
        return list(ffi.unpack(buf, n))

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character)."""
        self.check_token(token)
        buf = ffi.new("char[]", 64)
        n = lib().llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib().llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return bytes(ffi.buffer(buf, n)) if n > 0 else b""

    def detokenize(self, tokens: list[int], *, remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of a whole token list (invalid UTF-8 is replaced, never raised)."""
        for token in tokens:
            self.check_token(token)
        arr = ffi.new("llama_token[]", tokens) if tokens else ffi.NULL
        size = max(64, 8 * len(tokens))
        buf = ffi.new("char[]", size)
        n = lib().llama_detokenize(self.vocab, arr, len(tokens), buf, size, remove_special, unparse_special)
        if n < 0:
            size = -n
            buf = ffi.new("char[]", size)
            n = lib().llama_detokenize(self.vocab, arr, len(tokens), buf, size, remove_special, unparse_special)
        return bytes(ffi.buffer(buf, max(n, 0))).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""
        return bool(lib().llama_vocab_is_eog(self.vocab, token))

    def check_token(self, token: int) -> None:
        if not 0 <= token < self.n_vocab:
            raise KvrtError(f"token id {token} is outside the vocabulary [0, {self.n_vocab})")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.description}, {self.n_layer} layers"
        return f"Model({self.path.name!r}, {state})"
