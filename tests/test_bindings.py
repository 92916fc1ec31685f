"""The cffi declarations agree with llama.cpp's real layout, and the library is found."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvrt import bindings
from kvrt.bindings import ffi, lib
from kvrt.errors import LibraryError


@pytest.mark.parametrize(
    "c_name, ctypes_name",
    [
        ("struct llama_context_params", "llama_context_params"),
        ("struct llama_model_params", "llama_model_params"),
        ("struct llama_batch", "llama_batch"),
        ("struct llama_perf_context_data", "llama_perf_context_data"),
        ("struct llama_sampler_chain_params", "llama_sampler_chain_params"),
    ],
)
def test_struct_sizes_match_llama_cpp_python(c_name: str, ctypes_name: str) -> None:
    """llama-cpp-python's ctypes structs are an independent transcription of llama.h."""
    llama_cpp = pytest.importorskip("llama_cpp.llama_cpp")
    assert ffi.sizeof(c_name) == ctypes.sizeof(getattr(llama_cpp, ctypes_name))


@pytest.mark.parametrize("field", ["offload_kqv", "swa_full", "kv_unified", "no_perf", "ctx_other", "n_samplers"])
def test_context_param_field_offsets_match(field: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp.llama_cpp")
    ours = ffi.offsetof("struct llama_context_params", field)
    assert ours == getattr(llama_cpp.llama_context_params, field).offset


def test_defaults_read_through_our_layout() -> None:
    params = lib().llama_context_default_params()
    assert params.n_seq_max == 1
    assert params.offload_kqv is True
    assert 0 < params.n_ubatch <= params.n_batch


def test_version_and_devices_are_visible() -> None:
    assert ffi.string(lib().llama_version())
    g = bindings.ggml()
    assert g.ggml_backend_dev_count() >= 1
    names = [ffi.string(g.ggml_backend_dev_name(g.ggml_backend_dev_get(i))).decode()
             for i in range(g.ggml_backend_dev_count())]
    assert any(name.lower().startswith("cpu") for name in names)


def test_bad_library_dir_override_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(bindings.LIB_DIR_ENV, str(tmp_path))
    with pytest.raises(LibraryError, match=str(tmp_path)):
        bindings.library_dir()


def test_wrapped_host_memory_is_shared_not_copied() -> None:
    from kvrt.engine.ggml_memory import Buffer, aligned_empty

    host = aligned_empty(4096)
    host[:] = np.arange(4096) % 251
    with Buffer.wrap_host(host) as buf:
        assert buf.nbytes == host.nbytes
        assert buf.is_host
        assert buf.base == host.ctypes.data


def test_misaligned_host_memory_is_refused_instead_of_aborting() -> None:
    """ggml_backend_cpu_buffer_from_ptr GGML_ASSERTs on alignment: kvrt checks first."""
    from kvrt.engine.ggml_memory import Buffer, aligned_empty
    from kvrt.errors import KvrtError

    with pytest.raises(KvrtError, match="aligned"):
        Buffer.wrap_host(aligned_empty(4097)[1:])


def test_devices_report_memory() -> None:
    from kvrt.system.gpu import llama_devices

    found = llama_devices()
    assert found[0].kind in {"cpu", "gpu", "accel", "igpu"}
    assert any(d.kind == "cpu" for d in found)


def _stderr_lines(code: str) -> tuple[str, int]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout, len(done.stderr.splitlines())


def test_log_hook_keeps_llama_cpp_python_verbose_output(tiny_model_path) -> None:
    """kvrt's hook chains to llama-cpp-python's callback instead of replacing it."""
    _, alone = _stderr_lines(f"import llama_cpp; llama_cpp.Llama({str(tiny_model_path)!r}, verbose=True)")
    _, after_kvrt = _stderr_lines(
        f"from kvrt.engine.model import Model; m = Model({str(tiny_model_path)!r}); "
        f"import llama_cpp; llama_cpp.Llama({str(tiny_model_path)!r}, verbose=True)")
    assert alone > 100
    assert after_kvrt >= alone


def test_log_hook_is_quiet_on_its_own(tiny_model_path) -> None:
    """Nothing of llama.cpp's reaches stderr (a CUDA build's device banner included: see the next test)."""
    _, lines = _stderr_lines(f"from kvrt.engine.model import Model; Model({str(tiny_model_path)!r})")
    assert lines == 0


def test_log_hook_is_installed_before_the_first_library_call_that_may_log() -> None:
    """``import kvrt`` hooks llama.cpp's log as it opens the library: the backend registry, which a CUDA build
    announces on first use, is only touched afterwards."""
    out, _ = _stderr_lines("import kvrt; from kvrt.bindings import _log, ffi, lib\n"
                           "cb, data = ffi.new('ggml_log_callback *'), ffi.new('void **')\n"
                           "lib().llama_log_get(cb, data); "
                           "print(_log._hook is not None and cb[0] == _log._hook.callback)")
    assert out.strip() == "True"


def test_errors_keep_llama_cpp_words_after_llama_cpp_python_took_the_callback(tmp_path, tiny_model_path) -> None:
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_model_path.read_bytes()[: tiny_model_path.stat().st_size // 2])
    out, _ = _stderr_lines(
        f"import llama_cpp; llama_cpp.Llama({str(tiny_model_path)!r}, verbose=False)\n"
        "from kvrt.engine.model import Model\n"
        f"try:\n    Model({str(truncated)!r})\nexcept Exception as exc:\n    print(exc)")
    assert "not within the file bounds" in out or "failed to load model" in out
