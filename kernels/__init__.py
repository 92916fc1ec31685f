"""Numba CUDA kernels (installed as ``kvrt.kernels``); each also runs under the CUDA simulator.

numba-cuda as installed on the H200 machine (with NumPy 2.5) registers an overload
for ``numpy.row_stack`` while it builds its typing registries, at the first kernel
compile; NumPy 2.4 removed that alias, so every compile failed with AttributeError.
``row_stack`` was always ``vstack``: restoring the alias before any kernel compiles
lets numba-cuda load. Every kvrt kernel module imports this package first.
"""

import numpy as _np

if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack
