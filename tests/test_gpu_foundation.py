"""The bindings drive a CUDA build of llama.cpp: load on the GPU, decode, round-trip state."""

from __future__ import annotations

import numpy as np
import pytest

from kvrt import Context, Model
from kvrt.bindings import lib
from kvrt.engine.generation import prefill
from kvrt.system.gpu import llama_devices

pytestmark = pytest.mark.gpu

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def test_llama_cpp_sees_the_gpu() -> None:
    assert lib().llama_supports_gpu_offload(), "llama.cpp was built without a GPU backend"
    gpus = [d for d in llama_devices() if d.kind == "gpu"]
    assert gpus and gpus[0].total_bytes > 0


def test_gpu_decode_matches_cpu_and_state_round_trips(tiny_model_path) -> None:
    prompt_text = PROMPT
    with Model(tiny_model_path, n_gpu_layers=-1) as gpu_model, Model(tiny_model_path, n_gpu_layers=0) as cpu_model:
        tokens = gpu_model.tokenize(prompt_text)
        cont = gpu_model.tokenize(" and away", add_special=False)
        with Context(gpu_model, n_ctx=1024) as gctx, Context(cpu_model, n_ctx=1024, offload_kqv=False) as cctx:
            on_gpu = gctx.logits(prefill(gctx, tokens))
            on_cpu = cctx.logits(prefill(cctx, tokens))
            np.testing.assert_allclose(on_gpu, on_cpu, atol=2e-2 * np.abs(on_cpu).max())
            state = np.empty(gctx.seq_state_size(0), dtype=np.uint8)
            gctx.seq_state_get(0, state)
            expected = gctx.logits(prefill(gctx, cont))
        with Context(gpu_model, n_ctx=1024) as fresh:
            fresh.seq_state_set(state, 0)
            assert fresh.seq_len(0) == len(tokens)
            restored = fresh.logits(prefill(fresh, cont))
    assert np.array_equal(restored, expected)
