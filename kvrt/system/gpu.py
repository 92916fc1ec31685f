"""What GPUs this process can use, asked once in one place: NVML, CuPy and llama.cpp's own devices.

Each question has its own answer because they differ on real machines: NVML can see a
GPU that a CPU-only llama.cpp build cannot use, and CuPy can be missing where both see
one (then host pools are pageable). Every function here is safe on a machine with no GPU,
no driver and no CuPy: it answers "none" and says why where a reason helps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def nvidia_gpu_count() -> int:
    """NVIDIA GPUs visible through NVML (0 without the library, the driver or a device)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: no NVML GPU
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        pynvml.nvmlShutdown()


def cupy_with_device() -> tuple[Any | None, str]:
    """CuPy when it imports and sees at least one CUDA device, else ``None`` and the reason."""
    try:
        import cupy  # noqa: PLC0415  (GPU machines only)
    except ImportError as exc:
        return None, f"CuPy is not importable ({exc})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError and driver failures alike
        return None, f"the CUDA runtime sees no device ({exc})"
    if count == 0:
        return None, "the CUDA runtime reports 0 devices"
    return cupy, f"CuPy {getattr(cupy, '__version__', '(unknown version)')} with {count} device(s)"


def cupy_usable() -> bool:
    """True when CuPy can allocate pinned memory and device arrays here."""
    return cupy_with_device()[0] is not None


@dataclass(frozen=True)
class Device:
    """One ggml backend device of the loaded llama.cpp and its memory, as the backend reports it now."""

    index: int
    name: str
    description: str
    kind: str  # "cpu", "gpu", "igpu" or "accel" (ggml_backend_dev_type)
    free_bytes: int
    total_bytes: int


def llama_devices() -> list[Device]:
    """Every device the loaded ggml backends expose (the CPU is always one of them)."""
    from kvrt.bindings import DEVICE_TYPES, ffi, ggml

    g = ggml()
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    found = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        g.ggml_backend_dev_memory(dev, free, total)
        found.append(Device(index=i, name=ffi.string(g.ggml_backend_dev_name(dev)).decode(),
                            description=ffi.string(g.ggml_backend_dev_description(dev)).decode(),
                            kind=DEVICE_TYPES.get(g.ggml_backend_dev_type(dev), "unknown"),
                            free_bytes=int(free[0]), total_bytes=int(total[0])))
    return found


def llama_gpu_devices() -> list[Device]:
    """llama.cpp's GPU devices (ggml backend devices of type gpu or igpu); empty on a CPU build."""
    return [d for d in llama_devices() if d.kind in ("gpu", "igpu")]
