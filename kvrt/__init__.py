"""kvrt: many llama.cpp agents on one GPU, without redoing shared prefill and without OOM.

``import kvrt`` maps llama.cpp's libraries before anything imports NumPy (a CUDA build
was seen to segfault in model loading when NumPy came first: DEVELOPING.md) and raises
:class:`kvrt.errors.LibraryError` at once when they cannot be mapped. ``KVRT_NO_PRELOAD=1``
skips the mapping for processes that must not hold llama.cpp (figure drawing children).
GPU-only dependencies (CuPy, Numba CUDA, cuda-python) load only when used.
"""

from __future__ import annotations

import logging
import os

__version__ = "0.1.0"
NO_PRELOAD_ENV = "KVRT_NO_PRELOAD"
logging.getLogger(__name__).addHandler(logging.NullHandler())  # a library logs only where the app asks

if not os.environ.get(NO_PRELOAD_ENV):
    from kvrt.bindings import _loader

    _loader.llama()

from kvrt.accounting.ledger import VramLedger  # noqa: E402
from kvrt.branching.branches import Branch, fanout  # noqa: E402  (after the library is mapped)
from kvrt.branching.pipeline import Pipeline  # noqa: E402
from kvrt.engine.batch import Batch  # noqa: E402
from kvrt.engine.chat import ChatMessage, apply_chat_template  # noqa: E402
from kvrt.engine.context import Context  # noqa: E402
from kvrt.engine.context_params import ContextParams  # noqa: E402
from kvrt.engine.generation import Completion, GenerationParams, generate, prefill  # noqa: E402
from kvrt.engine.model import Model, ModelFingerprint, ModelParams  # noqa: E402
from kvrt.engine.sampling import Sampler, SamplingParams  # noqa: E402
from kvrt.errors import KvrtError  # noqa: E402
from kvrt.memory.elastic import ElasticPool  # noqa: E402
from kvrt.memory.elastic_kv import ElasticKV  # noqa: E402
from kvrt.modelfiles.demo_model import demo_model_path  # noqa: E402
from kvrt.serve.client import Client  # noqa: E402
from kvrt.serve.registry import ModelRegistry  # noqa: E402
from kvrt.serve.scheduler import Scheduler  # noqa: E402
from kvrt.state.hostpool import HostPool  # noqa: E402
from kvrt.state.snapshot import Snapshot  # noqa: E402
from kvrt.stream.streamer import LayerStreamer  # noqa: E402

__all__ = [
    "Batch", "Branch", "ChatMessage", "Client", "Completion", "Context", "ContextParams", "ElasticKV", "ElasticPool",
    "GenerationParams", "HostPool", "KvrtError", "LayerStreamer", "Model", "ModelFingerprint", "ModelParams",
    "ModelRegistry", "Pipeline", "Sampler", "SamplingParams", "Scheduler", "Snapshot", "VramLedger", "__version__",
    "apply_chat_template", "demo_model_path", "fanout", "generate", "prefill",
]
