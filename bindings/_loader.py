"""Find and open the llama.cpp shared libraries, once per process.

By default kvrt binds to the libraries that llama-cpp-python installs, so both talk to
the same copy of llama.cpp in the process and handles can be passed between them.
``KVRT_LLAMA_LIB_DIR`` points kvrt at a user's own build instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from kvrt.bindings._ffi import ffi
from kvrt.bindings._log import install
from kvrt.errors import LibraryError

LIB_DIR_ENV = "KVRT_LLAMA_LIB_DIR"
TESTED_LLAMA_CPP_PYTHON = "0.3.36"

_init_lock = threading.Lock()


def _shared_name(stem: str) -> str:
    if sys.platform == "darwin":
        return f"lib{stem}.dylib"
    if sys.platform == "win32":
        return f"{stem}.dll"
    return f"lib{stem}.so"


def library_dir() -> Path:
    """The directory holding libllama and libggml*, from the environment or llama_cpp."""
    override = os.environ.get(LIB_DIR_ENV)
    if override:
        path = Path(override)
        if not (path / _shared_name("llama")).exists():
            raise LibraryError(f"{LIB_DIR_ENV}={override!r} holds no {_shared_name('llama')}")
        return path
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise LibraryError(
            "llama-cpp-python is not installed; install it (pip install "
            f"llama-cpp-python=={TESTED_LLAMA_CPP_PYTHON}) or set {LIB_DIR_ENV} to a llama.cpp build"
        )
    path = Path(spec.origin).parent / "lib"
    if not (path / _shared_name("llama")).exists():
        raise LibraryError(f"llama_cpp at {path.parent} ships no {_shared_name('llama')} in lib/")
    return path


def _check_layout(lib: Any) -> None:
    """Refuse a library whose struct layout disagrees with our declarations.

    ABI mode cannot see the headers, so read llama.cpp's default parameters through
    our declarations: a shifted field shows up as an impossible default.
    """
    cparams = lib.llama_context_default_params()
    mparams = lib.llama_model_default_params()
    sane = (
        cparams.n_seq_max == 1
        and 0 < cparams.n_ubatch <= cparams.n_batch <= 1 << 20
        and cparams.offload_kqv is True
        and cparams.samplers == ffi.NULL
        and cparams.ctx_other == ffi.NULL
        and mparams.devices == ffi.NULL
        and mparams.vocab_only is False
    )
    if not sane:
        raise LibraryError(
            "llama.cpp's struct layout does not match kvrt's declarations "
            f"(kvrt was written against llama-cpp-python {TESTED_LLAMA_CPP_PYTHON}; "
            f"loaded llama.cpp reports version {ffi.string(lib.llama_version()).decode()!r})"
        )


@cache
def _open() -> tuple[Any, Any, bool]:
    """The mapped libllama and libggml, and whether NumPy was imported before them."""
    directory = library_dir()
    numpy_first = "numpy" in sys.modules
    # ggml-base first: libllama's own dependency lookup then finds the copy already mapped.
    try:
        ffi.dlopen(str(directory / _shared_name("ggml-base")))
        ggml_lib = ffi.dlopen(str(directory / _shared_name("ggml")))
        llama = ffi.dlopen(str(directory / _shared_name("llama")))
    except OSError as exc:
        raise LibraryError(f"cannot open llama.cpp libraries in {directory}: {exc}") from exc
    _check_layout(llama)
    return llama, ggml_lib, numpy_first


def llama() -> Any:
    """The opened libllama, with the backend initialised exactly once per process."""
    return _initialised()[0]


def ggml() -> Any:
    """The opened libggml (backend registry; its lookups also reach libggml-base's buffers)."""
    return _initialised()[1]


@cache
def _initialised() -> tuple[Any, Any]:
    """Map the libraries, route their log into Python's before any call that may log, initialise the backend.

    The log hook goes first because the backend registry logs when it is first touched (a CUDA
    build names its devices), and that would otherwise reach stderr past kvrt's logger.
    """
    with _init_lock:
        lib, ggml_lib, numpy_first = _open()
        install(lib)
        lib.llama_backend_init()
        if numpy_first and lib.llama_supports_gpu_offload():
            warnings.warn(
                "llama.cpp (a GPU build) was loaded after NumPy; on the H200 machine that order segfaulted "
                "in model loading. Import kvrt before numpy (tools/probe_import_order.py checks a machine).",
                RuntimeWarning,
                stacklevel=3,
            )
        return lib, ggml_lib


def install_logging() -> None:
    """Send llama.cpp's logging through Python's (:func:`kvrt.bindings._log.install`), opening the libraries first."""
    install(llama())
