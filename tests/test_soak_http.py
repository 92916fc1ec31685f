"""A short run of the HTTP soak (``tools/soak_http.py``): concurrent clients, streams dropped mid-way, bad
requests, then SIGTERM with streams open; every request accounted for, no error, a bounded clean exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the serve extra (pip install fastapi uvicorn) is not installed")

TOOL = Path(__file__).resolve().parents[1] / "tools" / "soak_http.py"


def test_a_short_http_soak_loses_nothing_and_shuts_down_cleanly(demo_model_path, tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(TOOL), "--duration-s", "4", "--clients", "4", "--threads", "1",
                           "--final-streams", "2", "--model", str(demo_model_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["errors"] == {} and summary["every_request_accounted"] and summary["completed"] > 0
    assert summary["bad_requests_refused_by_name"] == summary["bad_requests_sent"]
    end = summary["shutdown"]
    assert end["exit_status"] == 0 and end["streams_hung"] == 0
    assert sum(end["stream_outcomes"].get(k, 0) for k in ("done", "closed")) == end["open_streams"]
