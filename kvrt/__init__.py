"""kvrt: many llama.cpp agents on one GPU, without redoing shared prefill and without OOM.

Names are imported lazily so that ``import kvrt`` stays cheap and GPU-only parts
(CuPy, Numba) load only when used.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"
NO_PRELOAD_ENV = "KVRT_NO_PRELOAD"
logging.getLogger(__name__).addHandler(logging.NullHandler())  # a library logs only where the app asks


def _preload_llama() -> None:
    """Map llama.cpp before anything imports NumPy, where that is still possible.

    On the H200 machine a CUDA build of llama.cpp segfaulted inside
    ``llama_model_load_from_file`` whenever NumPy had been imported before the library
    was loaded, and never when the library came first (``tools/probe_import_order.py``
    shows both). So ``import kvrt`` opens the libraries at once; a failure here is left
    for the first real use to report. ``KVRT_NO_PRELOAD=1`` turns this off for processes
    that must not hold llama.cpp (see :mod:`kvrt.benchmarks._plotting`).
    """
    import os
    import sys

    if "numpy" in sys.modules or os.environ.get(NO_PRELOAD_ENV):
        return
    try:
        from kvrt.bindings import _loader

        _loader.llama()
    except Exception:  # reported, with its reason, by the first call that needs llama.cpp
        pass


_preload_llama()

_EXPORTS: dict[str, str] = {
    # foundation
    "Model": "kvrt.model",
    "ModelFingerprint": "kvrt.model",
    "Context": "kvrt.context",
    "ContextParams": "kvrt.context",
    "Batch": "kvrt.batch",
    "Sampler": "kvrt.sampling",
    "SamplingParams": "kvrt.sampling",
    "GenerationParams": "kvrt.generation",
    "Completion": "kvrt.generation",
    "generate": "kvrt.generation",
    "prefill": "kvrt.generation",
    "demo_model_path": "kvrt.demo_model",
    "KvrtError": "kvrt.errors",
    # compute once, fan out
    "Snapshot": "kvrt.snapshot",
    "HostPool": "kvrt.hostpool",
    "fanout": "kvrt.branches",
    "Branch": "kvrt.branches",
    "Pipeline": "kvrt.pipeline",
    # admission control and time-slicing
    "VramLedger": "kvrt.ledger",
    "ModelRegistry": "kvrt.registry",
    "Scheduler": "kvrt.scheduler",
    "Client": "kvrt.client",
    # layer streaming
    "LayerStreamer": "kvrt.streamer",
    # elastic KV memory
    "ElasticPool": "kvrt.elastic",
    "ElasticKV": "kvrt.elastic_kv",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
