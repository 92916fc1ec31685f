"""The batching harness: its loss count can see a loss, and a small run of it is clean and within its bounds."""

from __future__ import annotations

import argparse
import json

from kvrt.engine.model import Model
from kvrt.serve.results import DecodeResult, ended_early
from kvrt_bench import batching


def test_lost_or_mixed_counts_a_dropped_or_foreign_token(tiny_model_path):
    turns = ["hello there", " and more"]
    metrics = ended_early("a", "length", 0.0).metrics
    replies = [DecodeResult("a", "", [5, 6], "length", (), False, metrics) for _ in turns]
    with Model(tiny_model_path) as model:
        exact = (model.tokenize(turns[0], add_special=True) + [5, 6]
                 + model.tokenize(turns[1], add_special=False) + [5, 6])
        assert batching._lost_or_mixed(model, turns, replies, exact) == 0
        assert batching._lost_or_mixed(model, turns, replies, exact[:3] + exact[4:]) > 0  # one token lost
        assert batching._lost_or_mixed(model, turns, replies, exact + [7]) == 1  # one foreign token


def test_a_small_run_loses_nothing_and_stays_under_the_ideal(tiny_model_path, tmp_path):
    parser = argparse.ArgumentParser()
    batching.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_path), "--agents", "3", "--turns", "2", "--gen-tokens", "3",
                              "--slots", "4", "--ideal-steps", "2", "--threads", "1", "--n-gpu-layers", "0"])
    args.out = str(tmp_path)
    assert batching.run(args) == 0
    result = json.loads((tmp_path / "batching" / "batching.json").read_text())
    assert result["batched"]["lost_or_mixed_tokens"] == 0 and result["back_to_back"]["lost_or_mixed_tokens"] == 0
    assert all(r["generated_tokens"] == 3 * 2 * 3 for r in result["rounds"])
    for row in (r for r in result["rounds"] if r["arm"] == "batched"):
        # a turn takes a step for its prompt (which samples its first token) and one per later token, and an
        # agent's two turns follow each other: at least 2 x 3 steps
        assert row["steps"] >= 2 * 3 and 0 < row["decode_share_of_steps"] <= 1 and row["step_ms"] > 0
