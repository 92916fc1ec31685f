"""The daemon's budget: fixed, the GPU's memory through NVML, or a stated share of host RAM without a GPU."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvrt.accounting.budget import HOST_RAM_SHARE_PERCENT, choose_budget, host_ram_bytes


def _no_call() -> int:
    raise AssertionError("must not be asked")


def test_a_fixed_cap_wins() -> None:
    budget = choose_budget(1000, 90.0, gpu_count=_no_call, ram_bytes=_no_call)
    assert (budget.source, budget.capacity_bytes) == ("fixed", 1000)


def test_a_gpu_machine_keeps_the_nvml_cap() -> None:
    budget = choose_budget(None, 90.0, gpu_count=lambda: 1, ram_bytes=_no_call)
    assert (budget.source, budget.capacity_bytes, budget.share_percent) == ("nvml", None, 90.0)


def test_without_a_gpu_the_budget_is_a_share_of_host_ram() -> None:
    readings = iter([8 << 30])  # RAM is read once: the cap and the reason state the same number
    budget = choose_budget(None, 90.0, gpu_count=lambda: 0, ram_bytes=lambda: next(readings))
    assert (budget.source, budget.capacity_bytes) == ("host_ram", int((8 << 30) * HOST_RAM_SHARE_PERCENT / 100))
    assert "no NVIDIA GPU" in budget.reason and str(8 << 30) in budget.reason


def test_host_ram_is_read() -> None:
    assert host_ram_bytes() > 1 << 28


def test_serve_starts_without_a_gpu_or_a_capacity_and_status_names_the_budget(tmp_path: Path) -> None:
    from kvrt.serve.client import Client
    from kvrt.system.gpu import nvidia_gpu_count

    if nvidia_gpu_count():
        pytest.skip("this machine has a GPU: the NVML branch applies")
    path = tmp_path / "kvrt.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvrt.cli", "serve", "--socket", str(path), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline() if proc.stdout else ""
        assert "listening on" in banner and "host_ram" in banner, banner + (proc.stderr.read() if proc.stderr else "")
        with Client(path) as client:
            status = client.status()
        assert status["ledger_source"] == "host_ram"
        assert float(status["ledger_share_percent"]) == HOST_RAM_SHARE_PERCENT
        assert int(status["ledger_max_bytes"]) == int(host_ram_bytes() * HOST_RAM_SHARE_PERCENT / 100)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
