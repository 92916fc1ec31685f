"""The elastic benchmark's trace and simulator on the host driver (its GPU numbers come from the H200 run)."""

from __future__ import annotations

from kvrt.memory.vmm import HostDriver
from kvrt_bench._elastic_trace import bursty_trace, simulate, trace_models


def test_both_arms_serve_the_same_trace_and_elastic_holds_less():
    models = trace_models(3, 4096)
    trace = bursty_trace(models, duration_s=120.0, load=2.0, seed=3)
    assert trace and all(r.prompt + r.output <= 4096 for r in trace)
    assert [r.arrival for r in trace] == sorted(r.arrival for r in trace)
    cap = models[2].max_kv_bytes + models[0].max_kv_bytes  # each maximum fits alone, not all three at once
    results = {arm: simulate(arm, models, trace, cap, "host", HostDriver(1 << 16), 4)
               for arm in ("static", "elastic")}
    for result in results.values():
        assert result["requests"] == len(trace) and result["unserved"] == 0
        assert result["peak_bytes"] <= cap
        assert result["ttft_p50_ms"] > 0
    assert results["elastic"]["wait_p99_ms"] <= results["static"]["wait_p99_ms"]
    assert all(0.0 <= result["mem_wait_fraction"] <= result["queued_fraction"] + 1e-9 for result in results.values())
    assert not any(r.mem_wait or r.start for r in trace)  # each arm serves copies: the trace is not mutated


def test_part_c_spares_take_context_creation_off_the_path_and_tokens_stay_equal():
    import argparse

    from kvrt_bench._elastic_agent import part_c
    from kvrt_bench.elastic import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--part", "c", "--prompt-tokens", "1200", "--gen-tokens", "8", "--repeats", "1"])
    result = part_c(args)
    assert result["tokens_equal"] and result["final_ctx"] == 2048 and result["headline_arm"] == "spare"
    spare, no_ahead, cold = (result["median"][a] for a in ("spare", "spare-no-ahead", "cold"))
    # turn 1 (300 + 8 -> 512 cells) moves into the spare made at registration; grow-ahead (512 -> 1024) and a
    # 2048 spare between the turns, which turn 2 (1,215 cells) moves into: no context created on the path
    assert spare["on_path_create_ms"] == 0 and spare["on_path_spare_moves"] == spare["moves"] == 2
    assert spare["off_path_moves"] == 1 and spare["registration_spare_ms"] > 0 and spare["spares_used"] == 2
    # without grow-ahead, prepare() keeps a spare of the next bucket (1024) after turn 1, but turn 2 needs 2048:
    # that spare is dropped unused and 2048 is created on the path (the policy's limit, reported as such)
    assert no_ahead["on_path_spare_moves"] == 1 and no_ahead["moves"] == 2 and no_ahead["on_path_create_ms"] > 0
    assert (no_ahead["spares"], no_ahead["spares_used"]) == (2, 1)
    assert [(sp["n_ctx"], sp["outcome"]) for sp in result["per_arm"]["spare-no-ahead"]["last_run_spares"]] == [
        (512, "used"), (1024, "dropped")]
    assert cold["on_path_create_ms"] > 0 and cold["spares"] == 0
    assert all(result["median"][a]["spare_held_after_mb"] == 0 for a in ("spare", "spare-no-ahead", "cold"))
