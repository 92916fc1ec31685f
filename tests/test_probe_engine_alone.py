"""``tools/probe_engine_alone.py`` on the CPU: the peer's workloads on the engine with no HTTP front, every turn whole,
and every prompt token either prefilled or reused (the engine's counters against the prompts the probe sent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "probe_engine_alone.py"
AGENTS, GEN = 4, 4
SIZES = ("--private-history 96 --private-turns 2 --private-append 8 --swarm-doc 64 --swarm-task 16 --swarm-turns 3 "
         f"--swarm-append 8 --gen-tokens {GEN} --threads 1 --flash-attn off")


def test_the_engine_alone_runs_the_peers_turns_whole_and_counts_every_prompt_token(tiny_model_path, tmp_path):
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, str(TOOL), "--model", str(tiny_model_path), "--preset", "cpu",
                           "--agents", str(AGENTS), "--workloads", "private,swarm", "--peer-args", SIZES,
                           "--step-trace", str(tmp_path / "steps"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["engine_config"]["n_seq_max"] == AGENTS  # the peer's kvrt arm: a slot an agent
    rows = {row["workload"]: row for row in report["rounds"]}
    turns = {"private": 2, "swarm": 3}
    for name, row in rows.items():
        assert row["lost_tokens"] == 0 and row["output_tokens"] == AGENTS * turns[name] * GEN
        sizes = report["sizes"][name]
        first = sizes["shared"] + sizes["own"]
        # turn t's prompt: the first prompt, then each earlier turn's output and the new tokens appended to it
        sent = AGENTS * sum(first + t * (GEN + sizes["append"]) for t in range(turns[name]))
        assert row["kvrt_prefilled_tokens"] + row["kvrt_reused_tokens"] == sent
        assert row["kvrt_reused_tokens"] > 0  # later turns find their history cached
        assert (tmp_path / "steps" / f"engine-n{AGENTS}-r0-{name}.jsonl").read_text().count("\n") == row["kvrt_steps"]
