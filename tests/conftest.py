"""Shared fixtures: generated test models, the demo model, GPU detection, hypothesis profiles.

Kernels run under Numba's CUDA simulator wherever no NVIDIA GPU is visible, so the
same kernel tests run on CI (simulated) and on the GPU machine (real).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvrt.system.gpu import nvidia_gpu_count

HAS_GPU = nvidia_gpu_count() > 0
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile("deep", max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none visible through NVML on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer F32 llama GGUF with random weights (a few MB, deterministic)."""
    from kvrt.modelfiles.testmodels import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny.gguf", "tiny", seed=0)


@pytest.fixture(scope="session")
def other_tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shape as ``tiny_model_path``, different weights: a different model."""
    from kvrt.modelfiles.testmodels import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny-seed1.gguf", "tiny", seed=1)


@pytest.fixture(scope="session")
def tools_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights with a Jinja chat template that teaches tools (Hermes ``<tool_call>`` blocks in
    ChatML turns, as Qwen 2.5's does): ``tests/chat_templates/hermes_tools.jinja``."""
    from kvrt.modelfiles.testmodels import write_model

    template = (Path(__file__).parent / "chat_templates" / "hermes_tools.jinja").read_text()
    return write_model(tmp_path_factory.mktemp("models") / "tiny-tools.gguf", "tiny", seed=0, chat_template=template)


@pytest.fixture(scope="module")
def tools_server(tools_model_path: Path) -> Iterator[dict[str, Any]]:
    """kvrt's OpenAI server in-process on the tools test model (4 slots of 512 cells), as ``{"url", "model"}``;
    the model is served as ``tiny-tools``."""
    from kvrt.engine.model import Model
    from kvrt.runtime.admission import EngineConfig
    from kvrt.runtime.batching import Engine
    from kvrt.serve.openai_server import OpenAIServer

    model = Model(tools_model_path)
    engine = Engine(model, EngineConfig(n_ctx=2048, n_seq_max=4, n_batch=128, flash_attn="off"))
    server = OpenAIServer({"tiny-tools": engine}, default_max_tokens=48)
    host, port = server.start("127.0.0.1", 0)
    try:
        yield {"url": f"http://{host}:{port}", "model": model}
    finally:
        server.stop()
        engine.close()
        model.close()


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path: Path):
    from kvrt.engine.model import Model

    model = Model(tiny_model_path)
    yield model
    model.close()


@pytest.fixture(scope="session")
def demo_model_path() -> Path:
    """The real demo model (Gemma 3 270M Q4_K_M); skipped where the package is absent."""
    from kvrt.modelfiles.demo_model import INSTALL_HINT, demo_model_path, is_installed

    if not is_installed():
        pytest.skip(f"demo model not installed ({INSTALL_HINT})")
    return demo_model_path()


@pytest.fixture(scope="session")
def demo_model(demo_model_path: Path):
    from kvrt.engine.model import Model

    model = Model(demo_model_path)
    yield model
    model.close()


@pytest.fixture()
def sock_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private (0700) directory for Unix sockets under ``$TMPDIR``, named by process and thread; emptied and
    removed afterwards."""
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvrt-test-{os.getpid()}-{threading.get_ident() % 10000}"
    directory.mkdir(mode=0o700, exist_ok=True)
    yield directory
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()


@pytest.fixture()
def daemon(sock_dir: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A started socket daemon on ``sock_dir / "kvrt.sock"`` whose ledger holds the tiny model's weights twice and
    one live context of ``N_CTX`` cells (``tests/_serving.py``); stopped afterwards."""
    from _serving import N_CTX
    from kvrt.accounting.estimate import ModelShape, context_estimate
    from kvrt.accounting.ledger import VramLedger
    from kvrt.serve.daemon import Daemon
    from kvrt.serve.scheduler import Scheduler
    from test_scheduler import charge_estimates

    charge_estimates(monkeypatch)  # the ledger is sized from estimates, so it charges those on a GPU too
    shape = ModelShape.read(tiny_model_path)
    ledger = VramLedger(2 * shape.weight_bytes(on_gpu=False) + context_estimate(shape, N_CTX).total_bytes)
    scheduler = Scheduler(ledger, n_threads=1)
    server = Daemon(sock_dir / "kvrt.sock", scheduler).start()
    yield server
    server.stop()
