"""The elastic benchmark's trace and simulator on the host driver (its GPU numbers come from the H200 run)."""

from __future__ import annotations

from kvrt.benchmarks.elastic import bursty_trace, simulate, trace_models
from kvrt.vmm import HostDriver


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
