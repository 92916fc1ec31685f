"""The one cffi FFI (ABI mode) that holds kvrt's declarations of llama.h and ggml (:mod:`kvrt.bindings._cdef`).

Shared by the loader, which opens the libraries through it, and the log hook, whose
callback it builds; neither needs the other to get it.
"""

import cffi

from kvrt.bindings._cdef import CDEF, GGML_CDEF

ffi = cffi.FFI()
ffi.cdef(CDEF)
ffi.cdef(GGML_CDEF)
