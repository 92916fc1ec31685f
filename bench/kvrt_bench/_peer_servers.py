"""The two servers of ``kvrt bench peer`` as subprocesses, and llama.cpp's batched-bench for the ideal.

Both arms load the one libllama: ``kvrt serve`` loads llama-cpp-python's (kvrt's bindings
find it in ``llama_cpp/lib``), and llama-server (built by ``tools/build_llama_server.sh``
from the same llama.cpp source, shared libraries) runs with ``LD_LIBRARY_PATH`` set to
that folder, so its libllama/libggml SONAMEs resolve there too. After a server answers its
health check, the libllama files it mapped are read from ``/proc/PID/maps`` and recorded
with their SHA-256.

kvrt's stream carries every token's id (``return_tokens``); llama-server's OpenAI stream
does not, but with ``verbose`` every chunk holds its native form under ``__verbose``,
whose ``tokens`` are the chunk's token ids. llama-server holds a token back without a
chunk while its text ends inside a UTF-8 character, and that id never reaches the stream;
such a turn's ids are the server's own ``/tokenize`` of the completion text instead, and
the turn is counted as ``retokenized``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvrt.errors import KvrtError
from kvrt.system.cpu import EXTRA_BUFTS_ENV
from kvrt_bench._peer_client import TurnResult

LLAMA_SERVER_ENV = "KVRT_LLAMA_SERVER"
BATCHED_BENCH_ENV = "KVRT_BATCHED_BENCH"
HOST = "127.0.0.1"
UBATCH = 512
BENCH_ATTEMPTS = 3
LIBLLAMA = re.compile(r"/libllama\.so[.0-9]*$")


class PeerError(KvrtError):
    """An arm that cannot run: a binary not found, a server that did not start or does not answer."""


def find_llama_server(explicit: str | None) -> Path:
    """``explicit``, else ``$KVRT_LLAMA_SERVER``, else ``llama-server`` on PATH."""
    for where, value in (("--llama-server", explicit), (LLAMA_SERVER_ENV, os.environ.get(LLAMA_SERVER_ENV)),
                         ("PATH", shutil.which("llama-server"))):
        if value:
            path = Path(value)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise PeerError(f"llama-server from {where} ({path}) is not an executable file")
            return path
    raise PeerError(f"no llama-server: pass --llama-server PATH, set {LLAMA_SERVER_ENV}, or put one on PATH "
                    "(tools/build_llama_server.sh builds it from the llama.cpp that llama-cpp-python vendors)")


def find_batched_bench(explicit: str | None, server: Path) -> Path | None:
    """``explicit``, else ``$KVRT_BATCHED_BENCH``, else ``llama-batched-bench`` beside ``server`` or on PATH; None
    when there is none (the ideal is then not reported)."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise PeerError(f"--batched-bench {path} is not a file")
        return path
    for value in (os.environ.get(BATCHED_BENCH_ENV), str(server.with_name("llama-batched-bench")),
                  shutil.which("llama-batched-bench")):
        if value and Path(value).is_file():
            return Path(value)
    return None


def llama_lib_dir() -> Path:
    """The folder of the libllama kvrt loads (llama-cpp-python's ``llama_cpp/lib``, or ``$KVRT_LLAMA_LIB_DIR``)."""
    from kvrt.bindings import library_dir

    return library_dir()


def shared_library_env(lib: Path) -> dict[str, str]:
    """This environment with ``lib`` first on ``LD_LIBRARY_PATH``."""
    rest = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{rest}" if rest else str(lib)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def http_json(port: int, path: str, body: Any = None, timeout_s: float = 30.0) -> Any:
    """GET (``body`` None) or POST JSON to this machine's ``port``; the decoded answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")


@dataclass
class ServerConfig:
    """What both servers get alike: model, KV cells, agents (slots), batch sizes, flash attention, threads, and
    whether llama.cpp's extra CPU buffer types (AMX tiles, repacked weights) hold the weights kept on the CPU.

    ``extra_bufts`` is kvrt's verdict for this machine (``kvrt.system.cpu.safe_extra_bufts``): kvrt gets it through
    ``EXTRA_BUFTS_ENV``, llama.cpp's tools as ``--repack`` / ``--no-repack``, so every arm runs the same kernels and
    none meets the ones a VM advertises but kills the process for (README, "Machines that advertise more than they
    honour")."""

    model: Path
    cells: int
    slots: int
    n_batch: int
    prefill_chunk: int
    flash_attn: str
    threads: int | None
    extra_bufts: bool = True
    extra: list[str] = field(default_factory=list)  # arm-specific arguments, passed through

    def repack_flag(self) -> str:
        """llama.cpp's common option that sets ``extra_bufts``."""
        return "--repack" if self.extra_bufts else "--no-repack"


@dataclass
class ServerArm:
    """One server: its arm name, how it is started, and how its OpenAI stream is read (the client's Endpoint)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    health: str
    port: int
    model_name: str
    process: subprocess.Popen[bytes] | None = None
    libraries: dict[str, str] = field(default_factory=dict)
    host: str = HOST
    _log: IO[bytes] | None = None

    # -- process ------------------------------------------------------------------------
    def start(self, log_path: Path, timeout_s: float) -> None:
        """Start it and wait until its health route answers 200; a server that exits or stays unready is killed
        and reported with its log's last lines."""
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                        stdin=subprocess.DEVNULL)
        limit = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                self.stop()
                raise PeerError(f"{self.name} exited with {self.process.returncode} while starting: "
                                f"{_tail(log_path)}")
            try:
                http_json(self.port, self.health, timeout_s=5.0)
                break
            except (OSError, ValueError):  # not listening yet, or 503 while llama-server loads the model
                if time.monotonic() > limit:
                    self.stop()
                    raise PeerError(f"{self.name} did not answer {self.health} within {timeout_s:.0f} s: "
                                    f"{_tail(log_path)}") from None
                time.sleep(0.25)
        self.libraries = mapped_libllama(self.process.pid)

    def stop(self) -> None:
        """End the process (SIGTERM, then SIGKILL after 15 s); safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerArm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the client's view (kvrt_bench._peer_client.Endpoint) ------------------------------
    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                "return_tokens": True}
        return body | ({"verbose": True, "cache_prompt": True} if self.name.startswith("llama-server") else {})

    def chunk_tokens(self, chunk: dict[str, Any]) -> list[int]:
        if "__verbose" in chunk:
            return list(chunk["__verbose"].get("tokens") or [])
        return [t for choice in chunk.get("choices") or () for t in choice.get("tokens") or ()]

    def chunk_usage(self, chunk: dict[str, Any]) -> tuple[int | None, int | None]:
        usage = chunk.get("usage")
        if usage:
            return usage.get("completion_tokens"), (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        verbose = chunk.get("__verbose") or {}
        return (verbose.get("tokens_predicted"), None) if verbose.get("stop") else (None, None)

    def fill_gap(self, result: TurnResult) -> None:
        """Ids missing from the stream: the server's tokenization of the completion text (llama-server only;
        kvrt streams every id, so a gap there is an error)."""
        if not self.name.startswith("llama-server"):
            result.error = f"{self.name} streamed {len(result.tokens)} ids of {result.reported} tokens"
            return
        answer = http_json(self.port, "/tokenize", {"content": result.text, "add_special": False,
                                                    "parse_special": False})
        result.tokens, result.retokenized = [int(t) for t in answer["tokens"]], True
        result.received = result.reported or 0

    def kvrt_stats(self) -> dict[str, Any]:
        """kvrt's engine counters for the model (``GET /v1/kvrt/stats``); empty for llama-server."""
        if self.name != "kvrt":
            return {}
        return dict(http_json(self.port, "/v1/kvrt/stats")[self.model_name])


def kvrt_arm(config: ServerConfig) -> ServerArm:
    """``kvrt serve --http`` on a free port, this interpreter, the shared settings plus ``config.extra``."""
    port = free_port()
    argv = [sys.executable, "-m", "kvrt.cli", "serve", "--http", f"{HOST}:{port}", "--model", str(config.model),
            "--n-ctx", str(config.cells), "--slots", str(config.slots), "--n-batch", str(config.n_batch),
            "--prefill-chunk", str(config.prefill_chunk), "--flash-attn", config.flash_attn]
    argv += ["--threads", str(config.threads)] if config.threads else []
    env = dict(os.environ) | {EXTRA_BUFTS_ENV: "on" if config.extra_bufts else "off"}
    return ServerArm("kvrt", argv + config.extra, env, "/v1/models", port, config.model.stem)


def llama_server_arm(config: ServerConfig, binary: Path, lib: Path, unified: bool,
                     name: str | None = None) -> ServerArm:
    """llama-server on a free port with the same settings (``-np`` slots, ``-ub 512``, every layer offloaded, no
    automatic fitting that could change them), ``--kv-unified`` when ``unified``, plus ``config.extra``; ``name``
    names the arm (default: by its layout)."""
    port = free_port()
    argv = [str(binary), "-m", str(config.model), "-c", str(config.cells), "-np", str(config.slots),
            "-b", str(config.n_batch), "-ub", str(UBATCH), "-fa", config.flash_attn, "-ngl", "all", "--fit", "off",
            config.repack_flag(), "--host", HOST, "--port", str(port)]
    argv += ["-t", str(config.threads)] if config.threads else []
    argv += ["--kv-unified"] if unified else []
    name = name or ("llama-server-unified" if unified else "llama-server")
    return ServerArm(name, argv + config.extra, shared_library_env(lib), "/health", port, config.model.stem)


def mapped_libllama(pid: int) -> dict[str, str]:
    """The libllama files process ``pid`` has mapped, each with its SHA-256 (a wheel ships ``libllama.so`` and
    its SONAME ``libllama.so.0`` as copies, so the same library can show under two names); empty where /proc
    cannot tell."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return {}
    paths = {line.split()[-1] for line in maps.splitlines() if LIBLLAMA.search(line)}
    return {path: hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in sorted(paths)}


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def batched_bench(binary: Path, lib: Path, config: ServerConfig, prompt: int, gen: int, shared: bool,
                  timeout_s: float) -> dict[str, Any]:
    """The ideal of one workload: llama-batched-bench's point ``-npp prompt -ntg gen -npl slots`` (``-pps`` when
    the prompt is shared) with the same cells, batch sizes, flash attention and threads.

    A shared prompt is measured in both of llama.cpp's KV layouts and the faster one is the ideal: with one stream
    a sequence (llama.cpp's default) every sequence holds and reads its own copy of the prompt, in one unified
    stream every sequence reads the one copy, so neither is a floor alone. The answer is the chosen layout's
    figures, with both layouts' under ``layouts``."""
    if not shared:
        return _batched_bench_point(binary, lib, config, prompt, gen, shared, False, timeout_s)
    layouts = {name: _batched_bench_point(binary, lib, config, prompt, gen, shared, unified, timeout_s)
               for name, unified in (("split", False), ("unified", True))}
    measured = [name for name, point in layouts.items() if "t_s" in point]
    best = min(measured, key=lambda name: layouts[name]["t_s"]) if measured else "split"
    return layouts[best] | {"layout": best, "layouts": layouts}


def _batched_bench_point(binary: Path, lib: Path, config: ServerConfig, prompt: int, gen: int, shared: bool,
                         unified: bool, timeout_s: float) -> dict[str, Any]:
    """One run of llama-batched-bench in one KV layout (``unified``: ``-kvu``): its prompt, generation and total
    seconds. A point that does not fit the cells (each sequence's output, and the prompt once in the unified
    layout, else in every sequence) is reported as skipped, as batched-bench would skip it silently."""
    need = (prompt if shared and unified else config.slots * prompt) + config.slots * gen
    argv = [str(binary), "-m", str(config.model), "-c", str(config.cells), "-b", str(config.n_batch), "-ub",
            str(UBATCH), "-fa", config.flash_attn, "-ngl", "all", "-npp", str(prompt), "-ntg", str(gen),
            "-npl", str(config.slots), config.repack_flag(), "--output-format", "jsonl"]
    argv += (["-pps"] if shared else []) + (["-kvu"] if unified else [])
    argv += ["-t", str(config.threads)] if config.threads else []
    out: dict[str, Any] = {"argv": " ".join(argv), "prompt": prompt, "gen": gen, "n": config.slots, "shared": shared}
    if need > config.cells:
        return out | {"skipped": f"needs {need} cells, has {config.cells}"}
    for _ in range(BENCH_ATTEMPTS):  # its result line, printed by llama.cpp's log thread, was seen missing once
        try:
            run = subprocess.run(argv, capture_output=True, text=True, env=shared_library_env(lib),
                                 timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return out | {"skipped": f"did not finish within {timeout_s:.0f} s"}
        rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode != 0 or rows:
            break
    if run.returncode != 0 or not rows:
        return out | {"skipped": f"exit code {run.returncode}: {run.stderr.strip().splitlines()[-3:]}"}
    row = rows[-1]
    return out | {"t_pp_s": row["t_pp"], "t_tg_s": row["t_tg"], "t_s": row["t"], "speed_tg": row["speed_tg"],
                  "speed": row["speed"]}
