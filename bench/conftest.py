"""Fixtures shared by the microbenchmarks."""

from __future__ import annotations

import os

import pytest

from kvrt.engine.model import Model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    """The GGUF named by ``KVRT_BENCH_MODEL``, else a generated tiny F32 llama."""
    path = os.environ.get("KVRT_BENCH_MODEL")
    if not path:
        from kvrt.modelfiles.testmodels import write_model

        path = write_model(tmp_path_factory.mktemp("bench") / "tiny.gguf", "tiny", seed=0)
    with Model(path) as loaded:
        yield loaded
