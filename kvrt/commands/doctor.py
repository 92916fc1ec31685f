"""Report what kvrt sees: Python, llama.cpp and its backends, the CPU and kvrt's decision for it, GPUs, CuPy,
Numba, the demo model, and what would make this machine slower than it should be."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
from collections.abc import Callable
from typing import Any

HELP = "show what kvrt sees on this machine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _llama() -> list[str]:
    from kvrt.bindings import ffi, ggml, lib, library_dir
    from kvrt.system.gpu import llama_devices

    out = [
        f"library dir     {library_dir()}",
        f"llama.cpp       {ffi.string(lib().llama_version()).decode()}",
        f"gpu offload     {bool(lib().llama_supports_gpu_offload())}",
        f"system          {ffi.string(lib().llama_print_system_info()).decode().strip()}",
    ]
    g = ggml()
    regs = [ffi.string(g.ggml_backend_reg_name(g.ggml_backend_reg_get(i))).decode()
            for i in range(g.ggml_backend_reg_count())]
    out.append(f"backends        {', '.join(regs) or 'none'}")
    for dev in llama_devices():
        out.append(f"device {dev.index}        {dev.name} ({dev.kind}) {dev.description}: "
                   f"{dev.free_bytes / 2**30:.1f} / {dev.total_bytes / 2**30:.1f} GiB free")
    return out


def _cpu() -> list[str]:
    from kvrt.system.cpu import cpu_info, safe_extra_bufts

    info = cpu_info()
    verdict = safe_extra_bufts()
    features = " ".join(f"{k}={v}" for k, v in info.backend_features.items()) or "none reported"
    return [
        f"cpu             {info.model_name}",
        f"advertised      {' '.join(info.notable_flags) or 'no notable flags'}",
        f"llama.cpp cpu   {features}",
        f"extra bufts     {', '.join(info.extra_buffer_types) or 'none in this build'}",
        f"decision        use_extra_bufts={verdict.use_extra_bufts} ({verdict.source}, "
        f"{verdict.decision_ms:.1f} ms): {verdict.reason}",
        f"cached in       {verdict.cache_path or '-'}",
    ]


def warnings_for(*, nvml_gpus: int, llama_gpu_offload: bool, cupy_usable: bool) -> list[str]:
    """What would make a GPU machine run slower than it should, in plain words."""
    found = []
    if nvml_gpus and not llama_gpu_offload:
        found.append(f"{nvml_gpus} NVIDIA GPU(s) visible but llama.cpp is a CPU-only build: every model runs on "
                     "the CPU. Rebuild it with CUDA (README, 'On a GPU').")
    if nvml_gpus and not cupy_usable:
        found.append("an NVIDIA GPU is visible but CuPy is missing or unusable: host pools fall back to pageable "
                     "memory (about 7x slower swaps on an H200). Install the 'cuda' extra.")
    return found


def _warnings() -> list[str]:
    from kvrt.bindings import lib
    from kvrt.system.gpu import cupy_usable, nvidia_gpu_count

    found = warnings_for(nvml_gpus=nvidia_gpu_count(), llama_gpu_offload=bool(lib().llama_supports_gpu_offload()),
                         cupy_usable=cupy_usable())
    return found or ["none"]


def _nvml() -> list[str]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = [f"driver          {pynvml.nvmlSystemGetDriverVersion()}"]
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(f"gpu {i}           {pynvml.nvmlDeviceGetName(handle)}: "
                       f"{mem.used / 2**30:.1f} used / {mem.total / 2**30:.1f} GiB")
        return out
    finally:
        pynvml.nvmlShutdown()


def _cupy() -> list[str]:
    from kvrt.system.gpu import cupy_with_device

    return [f"cupy            {cupy_with_device()[1]}"]


def _numba() -> list[str]:
    import numba
    from numba import cuda

    return [f"numba           {numba.__version__}, CUDA available: {cuda.is_available()}"]


def _demo() -> list[str]:
    from kvrt.modelfiles.demo_model import INSTALL_HINT, is_installed

    if not is_installed():
        return [f"demo model      not installed ({INSTALL_HINT})"]
    from kvrt.modelfiles.demo_model import demo_model_path

    return [f"demo model      {demo_model_path()}"]


def _section(title: str, probe: Callable[[], list[str]]) -> None:
    print(f"[{title}]")
    try:
        lines: list[Any] = probe()
    except Exception as exc:  # a doctor reports every failure instead of stopping at the first
        lines = [f"unavailable: {type(exc).__name__}: {exc}"]
    for line in lines:
        print(f"  {line}")


def run(args: argparse.Namespace) -> int:
    del args
    import kvrt

    print(f"kvrt {kvrt.__version__} on Python {platform.python_version()} ({platform.machine()}, {platform.system()})")
    print(f"  llama-cpp-python {_version('llama-cpp-python')}, cffi {_version('cffi')}, numpy {_version('numpy')}")
    _section("llama.cpp", _llama)
    _section("CPU", _cpu)
    _section("NVML", _nvml)
    _section("CuPy", _cupy)
    _section("Numba", _numba)
    _section("demo model", _demo)
    _section("warnings", _warnings)
    return 0
