"""Numba CUDA kernels (installed as ``kvrt.kernels``); each also runs under the CUDA simulator.

numba-cuda (0.30 at least) registers an overload of ``numpy.row_stack`` when its
``numba.cuda.np.arrayobj`` module is imported, which happens at the first kernel compile;
NumPy 2.5 removed that alias, so on such a machine every compile failed with
AttributeError. :func:`_import_numba_cuda_arrayobj` imports that module once, now, with the
alias present only for the length of the import, so NumPy is left as it was for the rest
of the process. Every kvrt kernel module imports this package first.
"""

import importlib

import numpy as _np


def _import_numba_cuda_arrayobj() -> None:
    if hasattr(_np, "row_stack"):
        return  # NumPy < 2.5: nothing to bridge
    _np.row_stack = _np.vstack
    try:
        importlib.import_module("numba.cuda")
        importlib.import_module("numba.cuda.np.arrayobj")
    except ImportError:
        pass  # numba's own CUDA target (or the simulator) has no such module and needs no alias
    finally:
        del _np.row_stack


_import_numba_cuda_arrayobj()
