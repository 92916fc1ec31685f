"""Physical bounds on benchmark figures: the checker, the harnesses' bound lists, and the committed data.

No timing is asserted here: the figures are synthetic or read from bench/results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrt.errors import KvrtError
from kvrt_bench._bounds import EXIT_BOUND_VIOLATED, Bound, enforce, ideal_bound, speedup_bound, violations
from kvrt_bench._stats import check_samples, ratios, summarize

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
COMMITTED = sorted(p for p in RESULTS.glob("*-20??-??-??") if p.is_dir())


def test_a_speedup_over_n_fails_beyond_the_tolerance_only():
    assert not speedup_bound("x", 2.05, 2).exceeded(0.05)
    assert speedup_bound("x", 2.23, 2).exceeded(0.05)
    assert ideal_bound("y", 1.2, "the ideal").exceeded(0.05)
    assert [b.figure for b in violations([speedup_bound("a", 2.0, 2), speedup_bound("b", 53.0, 50)], 0.0)] == ["b"]


def test_enforce_writes_every_bound_and_names_the_violation(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bounds = [speedup_bound("fanout 3501 x 2, shared", 2.23, 2), ideal_bound("swap", 0.5, "pinned copy")]
    assert enforce(bounds, 0.05, tmp_path) == EXIT_BOUND_VIOLATED
    err = capsys.readouterr().err
    assert "BOUND VIOLATED: fanout 3501 x 2, shared = 2.23 > bound 2" in err and "swap" not in err.split("bounds:")[0]
    written = json.loads((tmp_path / "bounds.json").read_text())
    assert written["violated"] == 1 and [b["ok"] for b in written["bounds"]] == [False, True]
    assert enforce(bounds[1:], 0.05, tmp_path) == 0


def test_samples_need_three_and_ratios_pair_rounds():
    with pytest.raises(KvrtError):
        check_samples(2)
    assert check_samples(3) == 3
    s = ratios([10.0, 20.0, 30.0], [5.0, 5.0, 10.0])
    assert (s.median, s.min, s.max, s.n) == (3.0, 2.0, 4.0, 3)
    assert summarize([3.0, 1.0, 2.0]).spread == 1.0
    with pytest.raises(KvrtError):
        ratios([1.0], [1.0, 2.0])


def _rows(n: int, baseline: list[float], shared: list[float], ideal: list[float]) -> list[dict]:
    rows = []
    for arm, values in (("baseline", baseline), ("shared", shared), ("ideal", ideal)):
        for trial, value in enumerate(values, 1):
            rows.append({"Part": "sweep", "Doc_Tokens": 100, "N": n, "Arm": arm, "Trial": trial, "Fork": "",
                         "E2E_Ms": value, "Activation_Ms": value / 10, "Prefill_Ms": 1.0, "Fork_Ms": 0.0,
                         "Restore_Ms": 0.0, "Contexts_Created": 0, "Mismatched_Branches": 0, "_result": None})
    return rows


def test_fanout_point_bounds_catch_a_speedup_past_n_and_a_run_faster_than_the_ideal():
    from kvrt_bench.fanout import point_bounds, summarize_point

    fair = summarize_point(_rows(2, [200, 210, 190], [110, 105, 100], [100, 100, 95]), None)
    assert not violations(point_bounds(fair), 0.05)
    shared = next(r for r in fair if r["Arm"] == "shared")
    assert shared["Speedup_Vs_Baseline"] == pytest.approx(1.9)  # the median of 200/110, 210/105, 190/100
    broken = summarize_point(_rows(2, [300, 310, 290], [100, 100, 100], [120, 120, 120]), None)
    figures = {b.figure for b in violations(point_bounds(broken), 0.05)}
    assert figures == {"fanout 100 tokens x 2 branches, shared: e2e speed-up vs the warm baseline",
                       "fanout 100 tokens x 2 branches, shared: fraction of the ideal",
                       "fanout 100 tokens x 2 branches, ideal: e2e speed-up vs the warm baseline"}


def test_stream_bounds_hold_the_ideal_and_the_pipeline_bound():
    from kvrt_bench.stream import stream_bounds

    point = {"mode": "fma", "n_layers": 8, "compute_iters": 64, "fraction_of_ideal": 0.97, "speedup": 1.26,
             "pipeline_ideal_speedup": 1.25}
    assert not violations(stream_bounds([point]), 0.05)
    assert len(violations(stream_bounds([point | {"fraction_of_ideal": 1.3, "speedup": 1.5}]), 0.05)) == 2


@pytest.mark.parametrize("bounds_file", [p for folder in COMMITTED for p in sorted(folder.rglob("bounds.json"))],
                         ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_results_passed_their_bounds(bounds_file: Path):
    data = json.loads(bounds_file.read_text())
    bad = [b for b in data["bounds"]
           if Bound(b["figure"], b["value"], b["bound"], b["why"]).exceeded(data["tolerance"])]
    assert data["violated"] == 0 and not bad


@pytest.mark.parametrize("fanout_json", [p for folder in COMMITTED for p in sorted(folder.rglob("fanout.json"))],
                         ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_fanout_summaries_are_within_their_bounds_again(fanout_json: Path):
    from kvrt_bench.fanout import point_bounds

    data = json.loads(fanout_json.read_text())
    assert not violations(point_bounds(data["summary"]), data["args"]["bound_tolerance"])
    assert all(row["Samples"] >= 3 for row in data["summary"])
