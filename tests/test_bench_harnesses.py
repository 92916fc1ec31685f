"""The issue-13 harnesses on the tiny test model: every arm runs, the arms agree on the tokens, the
contexts policy is what each arm says. No timing is asserted (speed lives in the benchmarks)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")


def _args(**overrides) -> argparse.Namespace:
    base = dict(max_tokens=4, n_batch=512, threads=1, n_gpu_layers=-1, flash_attn="off", fork="during_prefill",
                ideal_decode="best")
    return argparse.Namespace(**(base | overrides))


def test_fanout_arms_agree_and_create_contexts_only_where_they_say(tiny_model):
    from kvrt_bench._fanout_arms import ARMS, make_setup, warm
    from kvrt_bench.fanout import measure_point, summarize_point

    arms = list(ARMS)
    setup = make_setup(tiny_model, 200, 3, arms, _args())
    try:
        warm(setup, arms, 2)
        rows = measure_point(setup, 3, arms, 3, "test")
    finally:
        setup.close()
    summary = {r["Arm"]: r for r in summarize_point(rows, None)}
    assert set(summary) == set(ARMS) and all(r["Samples"] == 3 for r in summary.values())
    for arm in ("naive", "peer-ram", "peer-disk", "isolated", "isolated-cold"):  # one branch at a time: exact
        assert summary[arm]["Mismatched_Branches"] == 0, arm
    assert summary["isolated"]["Contexts_Created"] == summary["shared"]["Contexts_Created"] == 0
    assert summary["naive"]["Contexts_Created"] == 3 and summary["isolated-cold"]["Contexts_Created"] >= 2
    assert summary["baseline"]["Speedup_Vs_Baseline"] == 1.0 and summary["ideal"]["Fraction_Of_Ideal"] == 1.0


def test_sweep_points_give_each_length_its_branch_counts():
    from kvrt_bench.fanout import sweep_points

    assert sweep_points("3501:8/50,32000:4", "1,2") == [(3501, [8, 50]), (32000, [4])]
    assert sweep_points("512", "1,2") == [(512, [1, 2])]


def test_swap_round_trip_is_exact_and_the_peer_picks_kvrts_next_token(tiny_model, tmp_path: Path):
    from kvrt.engine.batch import Batch
    from kvrt.engine.context import Context
    from kvrt.engine.context_params import ContextParams
    from kvrt.engine.generation import prefill
    from kvrt.state.hostpool import HostPool
    from kvrt_bench import _swap
    from kvrt_bench._peer import LlamaPeer

    params = ContextParams(n_ctx=512, n_threads=1, flash_attn="off")
    doc = _swap.document(tiny_model, 256)
    probe = tiny_model.tokenize(" fox", add_special=False)[0]
    with Context(tiny_model, params) as ctx, Batch(1) as one:
        prefill(ctx, doc, logits_last=False)
        reference = _swap.next_logits(ctx, one, probe, len(doc))
        trial = _swap.kvrt_trial(tiny_model, ctx, one, params, doc, probe, reference, HostPool(pinned=False))
    assert trial.exact and trial.nbytes > 0
    with LlamaPeer(tiny_model.path, n_ctx=512, n_threads=1) as peer:
        peer.llm.eval(doc)
        for kind in ("ram", "disk"):
            assert _swap.peer_trial(peer.llm, kind, doc, probe, tmp_path / kind).next_token == int(np.argmax(reference))


def test_multimodel_arms_serve_the_same_trace_with_the_same_tokens(tiny_model_path, other_tiny_model_path):
    from kvrt.accounting.ledger import VramLedger
    from kvrt.engine.model import Model
    from kvrt_bench.multimodel import ElasticArm, StaticArm, bursty_trace, replay

    trace = bursty_trace([512, 512], 1.0, 0.2, 0.05, 128, seed=1)
    assert trace == bursty_trace([512, 512], 1.0, 0.2, 0.05, 128, seed=1) and trace
    models = [Model(tiny_model_path), Model(other_tiny_model_path)]
    try:
        tokens = {}
        for name in ("static", "elastic"):
            ledger = VramLedger(64 << 20)
            arm = (StaticArm(models, 4096, ledger, 1) if name == "static"
                   else ElasticArm.register(models, 4096, ledger, 1))
            try:
                tokens[name] = [r["Tokens"] for r in replay(arm, name, trace, ledger, 1)]
            finally:
                arm.close()
            assert ledger.allocated_bytes == 0
    finally:
        for model in models:
            model.close()
    assert tokens["static"] == tokens["elastic"]
