"""The host CPU as the kernel and llama.cpp see it, and whether llama.cpp's CPU extra buffer types are safe on it.

llama.cpp keeps quantized weights in "extra" CPU buffer types (``AMX``, ``CPU_REPACK``,
``KLEIDIAI``) whose kernels use the newest instructions the CPU advertises. A CPU can
advertise what it does not honour (a VM that lists ``amx_tile`` without enabling tile
state): the AMX matmul then faults and takes the whole process down with SIGSEGV.

Invariant: a kvrt model loads with extra buffer types only after they were seen to
decode correctly on this CPU with this build of the libraries. The first process that
needs the answer runs the probe (:mod:`kvrt.modelfiles.cpu_probe`) in a child through
:func:`run_probe` (a crash there costs the child, never the caller); the verdict is
cached on disk per (CPU, library build), so later processes pay a file read.
``KVRT_EXTRA_BUFTS=on|off`` overrides the decision.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

EXTRA_BUFTS_ENV = "KVRT_EXTRA_BUFTS"
CACHE_DIR_ENV = "KVRT_CACHE_DIR"
PROBE_TIMEOUT_S = 120.0
PROBE_VERSION = 1
PROBE_CHILD = "kvrt.modelfiles.cpu_probe"  # started by name: it loads a model, which this layer sits below
_NOTABLE_PREFIXES = ("amx", "avx512", "avx_vnni", "sve", "sme2", "asimd")
_NOTABLE_FLAGS = frozenset({"avx2", "fma", "f16c", "sme", "i8mm", "bf16"})


@dataclass(frozen=True)
class CpuInfo:
    """What the kernel advertises and what llama.cpp's CPU backend was built and detected with."""

    model_name: str
    flags: frozenset[str]
    backend_features: Mapping[str, str]
    extra_buffer_types: tuple[str, ...]

    @property
    def notable_flags(self) -> list[str]:
        """The advertised flags that decide which llama.cpp kernels run (AMX, AVX-512, ...)."""
        return sorted(f for f in self.flags if f in _NOTABLE_FLAGS or f.startswith(_NOTABLE_PREFIXES))


@dataclass(frozen=True)
class ProbeOutcome:
    """What one probe child reported: ``ok`` only when it decoded and matched the plain kernels."""

    ok: bool
    detail: str
    elapsed_ms: float


@dataclass(frozen=True)
class ExtraBuftsVerdict:
    """Whether models load with ``use_extra_bufts``, where that came from and why.

    ``source`` is ``env`` (forced), ``none`` (this build has no extra buffer type, nothing
    to risk), ``cache`` (a verdict an earlier probe stored) or ``probe`` (decided now).
    ``decision_ms`` is what deciding cost this process: the probe, or the cache read.
    """

    use_extra_bufts: bool
    source: str
    reason: str
    decision_ms: float
    cache_path: Path | None = field(default=None, compare=False)


def advertised_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """The CPU model name and feature flags the kernel advertises (empty where there is no /proc)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    name, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and not name:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return name or platform.machine(), flags


def _cpu_backend() -> tuple[object, object]:
    from kvrt.bindings import ggml

    g = ggml()
    device = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    return device, g.ggml_backend_dev_backend_reg(device)


def backend_features() -> dict[str, str]:
    """llama.cpp's CPU backend features (``AMX_INT8``, ``AVX512``, ``REPACK``, ...): built in and detected."""
    from kvrt.bindings import ffi, ggml

    _, reg = _cpu_backend()
    address = ggml().ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if address == ffi.NULL:
        return {}
    features = ffi.cast("ggml_backend_get_features_t", address)(reg)
    found: dict[str, str] = {}
    i = 0
    while features != ffi.NULL and features[i].name != ffi.NULL:
        found[ffi.string(features[i].name).decode()] = ffi.string(features[i].value).decode()
        i += 1
    return found


def extra_buffer_types() -> tuple[str, ...]:
    """Names of the CPU's extra buffer types in this build of llama.cpp (empty when it has none)."""
    from kvrt.bindings import ffi, ggml

    device, reg = _cpu_backend()
    address = ggml().ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if address == ffi.NULL:
        return ()
    bufts = ffi.cast("ggml_backend_dev_get_extra_bufts_t", address)(device)
    names = []
    i = 0
    while bufts != ffi.NULL and bufts[i] != ffi.NULL:
        names.append(ffi.string(ggml().ggml_backend_buft_name(bufts[i])).decode())
        i += 1
    return tuple(names)


def cpu_info() -> CpuInfo:
    """This machine's :class:`CpuInfo` (maps llama.cpp's libraries if they are not yet)."""
    name, flags = advertised_flags()
    return CpuInfo(name, flags, backend_features(), extra_buffer_types())


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$KVRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrt``, else ``~/.cache/kvrt``."""
    if env.get(CACHE_DIR_ENV):
        return Path(env[CACHE_DIR_ENV])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "kvrt"


def probe_key(info: CpuInfo, library_files: Sequence[Path]) -> str:
    """Names one (CPU, library build) pair: any change to either asks for a new probe."""
    digest = hashlib.blake2b(digest_size=12)
    parts: list[object] = [PROBE_VERSION, platform.machine(), info.model_name, sorted(info.flags),
                           sorted(info.backend_features.items()), list(info.extra_buffer_types)]
    for path in sorted(library_files):
        stat = path.stat()
        parts.append([path.name, stat.st_size, stat.st_mtime_ns])
    digest.update(json.dumps(parts, default=str).encode())
    return digest.hexdigest()


def _library_files() -> list[Path]:
    from kvrt.bindings import library_dir

    directory = library_dir()
    return [p for p in directory.iterdir() if p.name.startswith(("libggml", "libllama", "ggml", "llama"))]


def run_probe(command: Sequence[str] | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeOutcome:
    """Run the probe child (by default ``python -m`` :data:`PROBE_CHILD`) and read its verdict.

    A child killed by a signal, one that exits non-zero, hangs past ``timeout_s`` or
    prints no verdict is a failed probe; nothing it does can reach the calling process.
    """
    argv = list(command) if command is not None else [sys.executable, "-m", PROBE_CHILD]
    env = {**os.environ, EXTRA_BUFTS_ENV: "on"}  # the child never probes itself
    t0 = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return ProbeOutcome(False, f"the probe child did not finish within {timeout_s:g} s", _ms(t0))
    except OSError as exc:
        return ProbeOutcome(False, f"the probe child could not start: {exc}", _ms(t0))
    elapsed = _ms(t0)
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() else "a signal"
        return ProbeOutcome(False, f"the probe child was killed by {name} while decoding through the extra "
                                   "buffer types", elapsed)
    last_line = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return ProbeOutcome(False, f"the probe child failed (exit {done.returncode}): {reason}", elapsed)
    try:
        report = json.loads(last_line)
        return ProbeOutcome(bool(report["ok"]), str(report["detail"]), elapsed)
    except (ValueError, KeyError, TypeError):
        return ProbeOutcome(False, f"the probe child printed no verdict (last line {last_line[:200]!r})", elapsed)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def decide_extra_bufts(
    info: CpuInfo,
    *,
    key: str,
    env: Mapping[str, str] = os.environ,
    directory: Path | None = None,
    probe: Callable[[], ProbeOutcome] = run_probe,
) -> ExtraBuftsVerdict:
    """The verdict for ``info``: forced by the environment, trivial, cached, or probed now and cached."""
    t0 = time.perf_counter()
    forced = env.get(EXTRA_BUFTS_ENV, "").strip().lower()
    if forced in ("on", "off"):
        return ExtraBuftsVerdict(forced == "on", "env", f"{EXTRA_BUFTS_ENV}={forced}", _ms(t0))
    if forced not in ("", "probe"):
        log.warning("ignoring %s=%r (expected on, off or probe)", EXTRA_BUFTS_ENV, forced)
    if not info.extra_buffer_types:
        return ExtraBuftsVerdict(True, "none", "this llama.cpp build has no CPU extra buffer types", _ms(t0))
    path = (directory or cache_dir(env)) / f"extra-bufts-{key}.json"
    cached = _read_cached(path)
    if cached is not None:
        return ExtraBuftsVerdict(cached.use_extra_bufts, "cache", cached.reason, _ms(t0), path)
    outcome = probe()
    names = ", ".join(info.extra_buffer_types)
    if outcome.ok:
        reason = f"{names} decoded correctly in a probe child ({outcome.detail})"
    else:
        reason = f"{names} disabled: {outcome.detail}"
        log.warning("llama.cpp's CPU extra buffer types are off for this machine: %s", outcome.detail)
    verdict = ExtraBuftsVerdict(outcome.ok, "probe", reason, _ms(t0), path)
    _write_cached(path, verdict, info)
    return verdict


def _read_cached(path: Path) -> ExtraBuftsVerdict | None:
    try:
        data = json.loads(path.read_text())
        return ExtraBuftsVerdict(bool(data["use_extra_bufts"]), "cache", str(data["reason"]), 0.0, path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable probe cache %s (%s); probing again", path, exc)
        return None


def _write_cached(path: Path, verdict: ExtraBuftsVerdict, info: CpuInfo) -> None:
    record = {k: v for k, v in asdict(verdict).items() if k in ("use_extra_bufts", "reason", "decision_ms")}
    record.update(cpu=info.model_name, extra_buffer_types=list(info.extra_buffer_types),
                  notable_flags=info.notable_flags, probe_version=PROBE_VERSION)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".partial") as fh:
            json.dump(record, fh, indent=1)
        os.replace(fh.name, path)
    except OSError as exc:  # a read-only home costs a probe per process, not a failure
        log.warning("cannot cache the extra buffer type verdict in %s: %s", path, exc)


_decide_lock = threading.Lock()


@functools.cache
def _process_verdict() -> ExtraBuftsVerdict:
    info = cpu_info()
    return decide_extra_bufts(info, key=probe_key(info, _library_files()))


def safe_extra_bufts() -> ExtraBuftsVerdict:
    """This process's verdict, decided once (thread-safe); what ``Model(use_extra_bufts=None)`` uses."""
    with _decide_lock:
        return _process_verdict()


_llama_cpp_lock = threading.Lock()


def llama_cpp_llama(model_path: str | os.PathLike[str], **kwargs: object) -> object:
    """A ``llama_cpp.Llama`` whose model loads with this machine's extra-buffer verdict.

    llama-cpp-python's ``Llama`` takes no ``use_extra_bufts``, so an unsafe CPU crashes it
    as it crashes kvrt. While this one is built, the default-parameters factory its module
    calls returns the verdict's value; the original is restored before returning, and the
    lock keeps two such constructions from interleaving.
    """
    import llama_cpp.llama as llama_module

    use_extra_bufts = safe_extra_bufts().use_extra_bufts
    bindings = llama_module.llama_cpp
    factory = bindings.llama_model_default_params

    def safe_defaults() -> object:
        params = factory()
        params.use_extra_bufts = use_extra_bufts
        return params

    with _llama_cpp_lock:
        bindings.llama_model_default_params = safe_defaults
        try:
            return llama_module.Llama(str(model_path), **kwargs)
        finally:
            bindings.llama_model_default_params = factory
