"""Model loading, metadata, vocabulary, and every way loading can go wrong."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvrt import Context, Model
from kvrt.errors import ClosedError, KvrtError, ModelLoadError
from kvrt.modelfiles.testmodels import PRESETS

TEXT = "Hello world, the quick brown fox jumps over the lazy dog. Ünïcödé ✓"


def test_metadata_matches_the_written_shape(tiny_model: Model) -> None:
    shape = PRESETS["tiny"]
    assert (tiny_model.n_layer, tiny_model.n_embd, tiny_model.n_head, tiny_model.n_head_kv) == (
        shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv)
    assert tiny_model.n_vocab == shape.n_vocab
    assert tiny_model.n_ctx_train == shape.n_ctx_train
    assert tiny_model.size_bytes == shape.weight_bytes() + 4 * (2 * shape.n_layer + 1) * shape.n_embd
    assert "random weights" in (tiny_model.meta("general.name") or "")
    assert tiny_model.meta("no.such.key") is None


def test_tokenize_matches_llama_cpp_python(tiny_model_path: Path, tiny_model: Model) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(tiny_model_path), vocab_only=True, verbose=False)
    assert tiny_model.tokenize(TEXT) == llm.tokenize(TEXT.encode())
    assert tiny_model.tokenize(TEXT, add_special=False) == llm.tokenize(TEXT.encode(), add_bos=False)


def test_detokenize_round_trips_text(tiny_model: Model) -> None:
    tokens = tiny_model.tokenize(TEXT, add_special=False)
    assert tiny_model.detokenize(tokens).strip() == TEXT
    pieces = b"".join(tiny_model.token_to_piece(t) for t in tokens)
    assert pieces.decode("utf-8").strip() == TEXT


def test_fingerprint_tells_models_apart(tiny_model: Model, other_tiny_model_path: Path) -> None:
    with Model(other_tiny_model_path) as other:
        assert tiny_model.fingerprint.mismatch(tiny_model.fingerprint) is None
        assert "content" in (tiny_model.fingerprint.mismatch(other.fingerprint) or "")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        Model(tmp_path / "absent.gguf")


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("this is not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        Model(path)


def test_truncated_gguf(tmp_path: Path, tiny_model_path: Path) -> None:
    path = tmp_path / "truncated.gguf"
    data = tiny_model_path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as info:
        Model(path)
    assert str(path) in str(info.value)


def test_use_after_close(tiny_model_path: Path) -> None:
    model = Model(tiny_model_path)
    model.close()
    with pytest.raises(ClosedError):
        model.tokenize("x")
    model.close()  # idempotent


def test_closing_a_model_closes_its_contexts_first(tiny_model_path: Path) -> None:
    model = Model(tiny_model_path)
    ctx = Context(model, n_ctx=64)
    model.close()
    assert ctx.closed
    with pytest.raises(ClosedError):
        _ = ctx.n_ctx


def test_out_of_vocabulary_token_is_refused(tiny_model: Model) -> None:
    with pytest.raises(KvrtError, match="outside the vocabulary"):
        tiny_model.token_to_piece(tiny_model.n_vocab)


def test_borrow_from_llama_cpp(tiny_model_path: Path, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    copy = tmp_path / "borrowed.gguf"
    shutil.copy(tiny_model_path, copy)
    llm = llama_cpp.Llama(str(copy), n_ctx=128, verbose=False)
    ctx = Context.from_llama_cpp(llm)
    assert ctx.model.n_layer == PRESETS["tiny"].n_layer
    assert ctx.n_ctx == llm.n_ctx()
    ctx.model.close()  # borrowed: forgets the handles, does not free them
    assert llm.tokenize(b"still alive")
    llm.close()


@pytest.mark.parametrize("overrides", [
    {"n_gpu_layers": -2}, {"n_gpu_layers": 1.5}, {"n_gpu_layers": True}, {"split_mode": "diagonal"},
    {"main_gpu": -1}, {"tensor_split": ()}, {"tensor_split": (1.0, -0.5)}, {"tensor_split": (float("nan"),)},
    {"use_mmap": "yes"}, {"use_extra_bufts": 1}, {"use_mlock": None}, {"no_such_parameter": 1},
])
def test_bad_model_parameters_are_refused_before_loading(tiny_model_path: Path, overrides: dict) -> None:
    with pytest.raises(KvrtError, match=next(iter(overrides))):
        Model(tiny_model_path, **overrides)


def test_model_parameters_reach_the_loaded_model(tiny_model_path: Path) -> None:
    from kvrt.engine.model import ModelParams

    params = ModelParams(n_gpu_layers=0, use_mmap=False, use_mlock=False, use_extra_bufts=False, check_tensors=True)
    with Model(tiny_model_path, params) as model:
        assert model.params == params
        assert model.tokenize("hi")
    with Model(tiny_model_path) as model:
        assert model.params.use_extra_bufts is not None  # the machine's verdict, decided


def test_borrowed_model_records_the_llama_cpp_parameters(tiny_model_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(tiny_model_path), n_gpu_layers=0, use_mmap=False, vocab_only=True, verbose=False)
    model = Model.from_llama_cpp(llm)
    assert (model.params.n_gpu_layers, model.params.use_mmap, model.params.use_mlock) == (0, False, False)
    assert model.params.use_extra_bufts is True  # llama-cpp-python's own default


def test_llama_cpp_llama_takes_the_machine_verdict(tiny_model_path: Path) -> None:
    from kvrt.system.cpu import llama_cpp_llama, safe_extra_bufts

    llm = llama_cpp_llama(tiny_model_path, vocab_only=True, verbose=False)
    assert bool(llm.model_params.use_extra_bufts) is safe_extra_bufts().use_extra_bufts
    import llama_cpp.llama_cpp as bindings

    assert bindings.llama_model_default_params().use_extra_bufts is True  # the factory is restored


CLOSE_UNDER_ENGINE = r"""
import sys
from kvrt import GenerationParams
from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.engine.model import Model
from kvrt.runtime.requests import Request
from kvrt.errors import KvrtError

model = Model(sys.argv[1])
engine = Engine(model, EngineConfig(n_ctx=1024, n_seq_max=2, n_batch=8, prefill_chunk=8, flash_attn="off"))
stream = engine.submit(Request(list(range(3, 100)), GenerationParams(max_tokens=40)))
stream.get(60)  # the first event: the prefill is running or done, decoding goes on
try:
    model.close()
    raise AssertionError("a model under a running engine was closed")
except KvrtError as exc:
    assert "in use by other threads" in str(exc), exc
assert not model.closed and not engine.ctx.closed  # the refusal changed nothing
assert stream.result(60).choices[0].finish_reason == "length"  # the request runs to its end
engine.close()
model.close()
assert model.closed
print("OK")
"""


def test_closing_a_model_under_a_running_engine_does_not_crash(tiny_model_path: Path) -> None:
    """llama_free ran while the engine's thread was in llama_decode (SIGSEGV / SIGABRT): a child process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CLOSE_UNDER_ENGINE, str(tiny_model_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, (done.returncode, done.stdout, done.stderr[-3000:])
