"""A loaded llama.cpp model: its handle, vocabulary and identity.

A :class:`Model` owns one ``llama_model *``. Contexts made from it are tracked so
that closing the model first closes them (llama.cpp would otherwise free a model
under a live context). Its :class:`ModelFingerprint` is what snapshots compare
before any state bytes reach llama.cpp.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from kvrt._handle import NativeHandle, OwnsHandle
from kvrt.bindings import capture, explain, ffi, lib
from kvrt.engine.file_digest import FileDigest
from kvrt.errors import KvrtError, ModelLoadError
from kvrt.system.cpu import safe_extra_bufts

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelFingerprint:
    """Identity of a model file plus the architecture numbers that shape its KV state.

    ``content`` is the digest of every byte of the file (:mod:`kvrt.engine.file_digest`:
    hashed once per version of the file, on a thread started at load, and cached), so a
    file changed anywhere, even at the same size and path, is another model.
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


SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}
_LOAD_MODES = {(False, False): 0, (True, False): 1, (False, True): 2, (True, True): 3}  # (mmap, mlock)


@dataclass(frozen=True)
class ModelParams:
    """The llama.cpp model parameters kvrt sets; everything else keeps llama.cpp's default.

    ``n_gpu_layers=-1`` offloads every layer when llama.cpp has a GPU and is a no-op on a
    CPU build. ``use_mmap=None`` lets llama.cpp pick how to read the file. ``use_extra_bufts``
    ``None`` takes the machine's safe verdict (:func:`kvrt.system.cpu.safe_extra_bufts`): llama.cpp's
    AMX / repacked-weight kernels only where a probe saw them work.
    """

    n_gpu_layers: int = -1
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None
    use_mmap: bool | None = None
    use_mlock: bool = False
    use_extra_bufts: bool | None = None
    check_tensors: bool = False

    def __post_init__(self) -> None:
        for name in ("n_gpu_layers", "main_gpu"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (-1 if name == "n_gpu_layers" else 0):
                raise KvrtError(f"ModelParams.{name} must be an integer >= {-1 if name == 'n_gpu_layers' else 0}, "
                                f"got {value!r}")
        if self.split_mode not in SPLIT_MODES:
            raise KvrtError(f"split_mode must be one of {sorted(SPLIT_MODES)}, got {self.split_mode!r}")
        if self.tensor_split is not None and (
                not self.tensor_split or any(not isinstance(x, int | float) or not x >= 0 for x in self.tensor_split)):
            raise KvrtError(f"tensor_split must be non-negative proportions, one per device, got {self.tensor_split!r}")
        for name in ("use_mmap", "use_extra_bufts"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise KvrtError(f"ModelParams.{name} must be True, False or None, got {getattr(self, name)!r}")
        for name in ("use_mlock", "check_tensors"):
            if not isinstance(getattr(self, name), bool):
                raise KvrtError(f"ModelParams.{name} must be a bool, got {getattr(self, name)!r}")

    def resolved(self) -> ModelParams:
        """These parameters with ``use_extra_bufts`` decided (the probe runs at most once per machine)."""
        if self.use_extra_bufts is not None:
            return self
        return replace(self, use_extra_bufts=safe_extra_bufts().use_extra_bufts)

    def to_c(self) -> tuple[Any, Any]:
        """The ``llama_model_params`` struct and the buffers it points into (keep both alive)."""
        params = lib().llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        params.split_mode = SPLIT_MODES[self.split_mode]
        params.main_gpu = self.main_gpu
        params.check_tensors = self.check_tensors
        params.use_extra_bufts = bool(self.resolved().use_extra_bufts)
        if self.use_mmap is not None or self.use_mlock:
            params.load_mode = _LOAD_MODES[(bool(self.use_mmap), self.use_mlock)]
        params.tensor_split = split = self._tensor_split_c()
        return params, split

    def _tensor_split_c(self) -> Any:
        """``tensor_split`` as llama.cpp reads it: ``llama_max_devices()`` floats (it reads one per device it has,
        so a shorter array would be read past its end on a machine with more GPUs), or NULL."""
        if not self.tensor_split:
            return ffi.NULL
        most = int(lib().llama_max_devices())
        if len(self.tensor_split) > most:
            raise KvrtError(f"tensor_split has {len(self.tensor_split)} proportions; this llama.cpp takes at most "
                            f"{most} devices")
        return ffi.new("float[]", [float(x) for x in self.tensor_split] + [0.0] * (most - len(self.tensor_split)))


def _params_of_llama_cpp(c_params: Any) -> ModelParams:
    """The :class:`ModelParams` a ``llama_cpp.Llama`` loaded its model with (its ctypes struct)."""
    mmap, mlock = next((k for k, v in _LOAD_MODES.items() if v == c_params.load_mode), (None, False))
    return ModelParams(
        n_gpu_layers=max(int(c_params.n_gpu_layers), -1),
        split_mode={v: k for k, v in SPLIT_MODES.items()}.get(int(c_params.split_mode), "layer"),
        main_gpu=int(c_params.main_gpu), use_mmap=mmap, use_mlock=mlock,
        use_extra_bufts=bool(c_params.use_extra_bufts), check_tensors=bool(c_params.check_tensors),
    )


class Model(OwnsHandle):
    """A llama.cpp model, loaded from a GGUF file or borrowed from llama-cpp-python.

    ``params`` (or keyword overrides of :class:`ModelParams`' fields) choose devices,
    loading and kernels; ``progress`` receives load progress in [0, 1].
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        params: ModelParams | None = None,
        *,
        progress: Callable[[float], None] | None = None,
        **overrides: Any,
    ) -> None:
        self.path = Path(path).resolve()
        _check_file(self.path)
        unknown = sorted(set(overrides) - {f.name for f in fields(ModelParams)})
        if unknown:
            known = [f.name for f in fields(ModelParams)]
            raise KvrtError(f"unknown model parameter(s) {unknown}; ModelParams has {known}")
        self.params = replace(params or ModelParams(), **overrides).resolved()
        c_params, keep_split = self.params.to_c()
        keep_alive: Any = None
        if progress is not None:

            def on_progress(fraction: float, _user: Any) -> bool:
                progress(fraction)
                return True

            keep_alive = ffi.callback("bool(float, void *)", on_progress)
            c_params.progress_callback = keep_alive
        with capture() as lines:
            ptr = lib().llama_model_load_from_file(str(self.path).encode(), c_params)
        del keep_alive, keep_split
        if ptr == ffi.NULL:
            raise ModelLoadError(
                "llama_model_load_from_file", explain(lines, "llama.cpp could not load the model"), path=str(self.path)
            )
        self._handle = NativeHandle(ptr, lib().llama_model_free, f"model {self.path.name}")
        self._contexts: weakref.WeakSet[OwnsHandle] = weakref.WeakSet()
        self._fingerprint: ModelFingerprint | None = None
        self._digest = FileDigest(self.path)
        self._pieces: dict[int, bytes] = {}  # token -> its bytes (special=False): a vocabulary never changes
        self._eog: dict[int, bool] = {}  # token -> whether it ends generation

    @classmethod
    def from_llama_cpp(cls, llm: Any) -> Model:
        """Borrow the model of a ``llama_cpp.Llama`` (it stays owned by ``llm``)."""
        handle = NativeHandle.borrow(llm.model, "struct llama_model *", "model")
        self = cls.__new__(cls)
        self.path = Path(llm.model_path).resolve()
        self.params = _params_of_llama_cpp(llm.model_params)
        self._handle = handle
        self._contexts = weakref.WeakSet()
        self._fingerprint = None
        self._digest = FileDigest(self.path)
        self._pieces, self._eog = {}, {}
        return self

    # -- lifetime -------------------------------------------------------------------
    def _adopt(self, context: OwnsHandle) -> None:
        """Track a context made from this model (:class:`kvrt.engine.context.Context` calls it) for :meth:`close`."""
        self._contexts.add(context)

    def close(self) -> None:
        """Free the model, closing every context made from it first.

        Refused (:class:`KvrtError` naming them, nothing closed) while another thread is
        inside a call on one of its contexts, e.g. an :class:`kvrt.runtime.batching.Engine`
        still running on it: close that first. Otherwise the model is freed once no thread
        is inside one of its own calls (tokenizing, ...); closing never frees memory
        llama.cpp is using.
        """
        me = threading.get_ident()
        busy = [c for c in list(self._contexts) if not c.closed and c._handle.used_by_others(me)]
        if busy:
            raise KvrtError(f"model {self.path.name} cannot be closed: {len(busy)} of its contexts are in use by "
                            f"other threads ({', '.join(map(repr, busy))}); close them (or their engines) first")
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

    @functools.cached_property
    def n_vocab(self) -> int:
        """Tokens in the vocabulary (read once: every token check asks for it)."""
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
                return str(ffi.string(buf).decode("utf-8", "replace"))
            size = n + 1

    @property
    def fingerprint(self) -> ModelFingerprint:
        if self._fingerprint is None:
            self._fingerprint = ModelFingerprint(
                content=self._digest.result(),
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
        """The bytes of one token (may be part of a UTF-8 character). Remembered per token (``special=False``):
        every sampled token is turned into text, and a lookup costs a fraction of llama.cpp's call through cffi."""
        piece = None if special else self._pieces.get(token)
        if piece is None:
            piece = self._piece(token, special)
            if not special:
                self._pieces[token] = piece
        return piece

    def _piece(self, token: int, special: bool) -> bytes:
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

    def special_text(self, which: Literal["bos", "eos"]) -> str:
        """The text of the BOS or EOS token ("" when the vocabulary has none): what chat templates call
        ``bos_token`` / ``eos_token``."""
        token = int((lib().llama_vocab_bos if which == "bos" else lib().llama_vocab_eos)(self.vocab))
        return self.token_to_piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...); remembered per token, like :meth:`token_to_piece`."""
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = self._is_eog(token)
        return eog

    def _is_eog(self, token: int) -> bool:
        return bool(lib().llama_vocab_is_eog(self.vocab, token))

    def check_token(self, token: int) -> None:
        if not 0 <= token < self.n_vocab:
            raise KvrtError(f"token id {token} is outside the vocabulary [0, {self.n_vocab})")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.description}, {self.n_layer} layers"
        return f"Model({self.path.name!r}, {state})"


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` with the model's handle held: :meth:`Model.close` waits for it (see :class:`NativeHandle`)."""
    @functools.wraps(method)
    def call(self: Model, *args: Any, **kwargs: Any) -> Any:
        with self._handle.use():
            return method(self, *args, **kwargs)

    return call


for _name in ("tokenize", "_piece", "detokenize", "_is_eog", "meta"):
    setattr(Model, _name, _guarded(getattr(Model, _name)))
