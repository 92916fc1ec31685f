"""cffi (ABI mode) bindings to the llama.cpp and ggml shared libraries.

``lib()`` is libllama, ``ggml()`` libggml-base, ``ffi`` their shared FFI. Everything
above this package goes through :mod:`kvrt.engine.model` and :mod:`kvrt.engine.context`, which own
the handles and turn every NULL and error code into a :class:`kvrt.errors.KvrtError`.
"""

from kvrt.bindings._ffi import ffi
from kvrt.bindings._loader import (
    LIB_DIR_ENV,
    TESTED_LLAMA_CPP_PYTHON,
    ggml,
    install_logging,
    library_dir,
)
from kvrt.bindings._loader import llama as lib
from kvrt.bindings._log import capture, explain

STATE_SEQ_FLAGS_NONE = 0
STATE_SEQ_FLAGS_PARTIAL_ONLY = 1
STATE_SEQ_FLAGS_ON_DEVICE = 2

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}

__all__ = [
    "DEVICE_TYPES",
    "FLASH_ATTN",
    "LIB_DIR_ENV",
    "STATE_SEQ_FLAGS_NONE",
    "STATE_SEQ_FLAGS_ON_DEVICE",
    "STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "TESTED_LLAMA_CPP_PYTHON",
    "capture",
    "explain",
    "ffi",
    "ggml",
    "install_logging",
    "lib",
    "library_dir",
]
