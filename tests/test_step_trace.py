"""The engine's step trace against its own counters, the micro-batch count in both layouts, and the trace reader."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrt.engine.generation import GenerationParams
from kvrt.engine.sampling import SamplingParams
from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import Request
from kvrt.runtime.step_trace import StepTrace, read_trace

WAIT_S = 60.0
REPO = Path(__file__).resolve().parents[1]


def run_three(model, layout: str, trace_path: Path) -> tuple[Engine, list]:
    """Three requests of different prompt lengths together (chunks of 8 tokens, 32 a step), traced."""
    config = EngineConfig(n_ctx=1024, n_seq_max=4, n_batch=32, prefill_chunk=8, flash_attn="off", kv_layout=layout)
    engine = Engine(model, config, trace=StepTrace(trace_path))
    prompts = [model.tokenize(" ".join(["word"] * n)) for n in (5, 19, 40)]
    params = GenerationParams(max_tokens=6, sampling=SamplingParams(temperature=0.0))
    streams = [engine.submit(Request(p, params)) for p in prompts]
    for stream in streams:
        stream.result(WAIT_S)
    return engine, prompts


@pytest.mark.parametrize("layout", ["split", "unified"])
def test_the_trace_adds_up_to_the_engines_counters(tiny_model, tmp_path, layout):
    trace_path = tmp_path / "steps" / "tiny.jsonl"
    engine, prompts = run_three(tiny_model, layout, trace_path)
    try:
        stats = engine.stats()
    finally:
        engine.close()
    steps = read_trace(trace_path)
    assert len(steps) == stats.steps > 0
    assert sum(s.prompt_tokens for s in steps) == stats.prefilled_tokens
    assert stats.prefilled_tokens + stats.reused_tokens == sum(len(p) for p in prompts)
    assert sum(s.decode_rows for s in steps) == stats.decoded_tokens
    assert sum(s.micro_batches for s in steps) == stats.micro_batches
    assert all(s.tokens == s.decode_rows + s.prompt_tokens and s.layout == layout for s in steps)
    assert all(s.prompt_chunks <= 3 and s.prompt_tokens <= 8 * s.prompt_chunks for s in steps)
    if layout == "unified":  # 32 tokens a step at most, n_ubatch 512: one micro-batch each
        assert {s.micro_batches for s in steps} == {1}
    else:  # three prompts' 8-token chunks in one step: a micro-batch of 3 x 8 tokens; a chunk beside a shorter
        assert max(s.micro_batches for s in steps) >= 2  # last one, or beside decode rows, costs another
    assert [t.t_s for t in steps] == sorted(t.t_s for t in steps)
    for s in steps:  # each step's shape holds its tokens and sequences, in slot order
        assert sum(n for _, n in s.shape) == s.tokens + s.pads and len(s.shape) == s.sequences + s.pads
        assert [slot for slot, _ in s.shape] == sorted(slot for slot, _ in s.shape)


def test_a_cut_last_line_is_left_out_and_a_bad_line_is_named(tmp_path):
    good = {"t_s": 1.0, "admit_ms": 0.1, "fill_ms": 0.1, "decode_ms": 2.0, "sample_ms": 0.2, "host_cpu_ms": 0.3,
            "tokens": 3, "decode_rows": 3, "prompt_tokens": 0, "prompt_chunks": 0, "sequences": 3,
            "micro_batches": 1, "live": 3, "queued": 0, "layout": "split"}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good)[:40])
    assert len(read_trace(path)) == 1
    path.write_text(json.dumps(good) + "\n{\"t_s\": 2}\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: not a step record"):
        read_trace(path)


def test_the_summary_tool_groups_a_real_trace(tiny_model, tmp_path):
    trace_path = tmp_path / "tiny.jsonl"
    engine, _ = run_three(tiny_model, "split", trace_path)
    engine.close()
    out = subprocess.run([sys.executable, str(REPO / "tools" / "step_trace_summary.py"), str(trace_path)],
                         capture_output=True, text=True, check=True).stdout
    steps = read_trace(trace_path)
    assert f"{len(steps)} steps" in out
    assert f"waited in the queue up to {max(s.waited_ms for s in steps):.1f} ms" in out
    assert any(line.split()[:1] == ["decode"] for line in out.splitlines())  # the last steps decode alone
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "step_trace_summary.py"), str(tmp_path / "none")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "none" in bad.stderr


def test_a_pools_engine_traces_to_its_models_file(tiny_model_path, tmp_path):
    """ModelPool(step_trace_dir=DIR) (kvrt serve --step-trace DIR): a model's engine writes DIR/<model>.jsonl, and
    the file is whole once the pool is closed."""
    from kvrt.accounting.ledger import VramLedger
    from kvrt.serve.model_pool import ModelPool
    from kvrt.serve.registry import ModelRegistry

    registry = ModelRegistry(VramLedger(8 << 30), table={tiny_model_path.name: 1 << 20}, measure=False)
    config = EngineConfig(n_ctx=512, n_seq_max=2, n_batch=64, prefill_chunk=16, flash_attn="off")
    pool = ModelPool(registry, config, models={"tiny": tiny_model_path}, step_trace_dir=tmp_path / "steps")
    try:
        pool.preload("tiny")
        held = pool.hold("tiny")
        assert held is not None
        engine, release = held
        engine.submit(Request([1, 2, 3, 4, 5], GenerationParams(max_tokens=3))).result(WAIT_S)
        steps = engine.stats().steps
        release()
    finally:
        pool.close_engines()
        pool.close()
        registry.close()
    assert len(read_trace(tmp_path / "steps" / "tiny.jsonl")) == steps > 0


def test_a_trace_path_that_cannot_be_written_is_named_before_any_model_loads(tmp_path, tiny_model_path):
    from kvrt.accounting.ledger import VramLedger
    from kvrt.errors import KvrtError
    from kvrt.serve.model_pool import ModelPool
    from kvrt.serve.registry import ModelRegistry

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(KvrtError, match=r"cannot write .*a-file/steps/t\.jsonl"):
        StepTrace(blocker / "steps" / "t.jsonl")
    registry = ModelRegistry(VramLedger(8 << 30), table={tiny_model_path.name: 1 << 20}, measure=False)
    config = EngineConfig(n_ctx=512, n_seq_max=2, n_batch=64, prefill_chunk=16, flash_attn="off")
    try:
        with pytest.raises(KvrtError, match=r"--step-trace .*a-file/steps"):
            ModelPool(registry, config, models={"tiny": tiny_model_path}, step_trace_dir=blocker / "steps")
        assert registry.models() == []  # nothing loaded
    finally:
        registry.close()


def test_the_summary_tool_names_the_steps_with_surplus_micro_batches(tmp_path):
    """A step of 15 prompt chunks of 129 tokens in runs broken by slots without a turn: 8 micro-batches where its
    1,935 tokens need 4 (a swarm transition of the H100 trace); the tool names it with its runs of slots."""
    chunks = [[slot, 129] for slot in (0, 1, 2, 5, 6, 7, 9, 10, 11, 12, 20, 21, 22, 23, 30)]
    step = {"t_s": 1.0, "admit_ms": 0.1, "fill_ms": 1.1, "decode_ms": 136.5, "sample_ms": 1.1, "host_cpu_ms": 2.0,
            "tokens": 1935, "decode_rows": 0, "prompt_tokens": 1935, "prompt_chunks": 15, "sequences": 15,
            "micro_batches": 8, "live": 32, "queued": 0, "layout": "split", "pads": 0, "shape": chunks}
    plain = step | {"t_s": 1.2, "micro_batches": 4, "shape": [[s, 129] for s in range(15)]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(step) + "\n" + json.dumps(plain) + "\n")
    out = subprocess.run([sys.executable, str(REPO / "tools" / "step_trace_summary.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    named = [line.strip() for line in out.splitlines() if line.startswith("  +")]
    assert named == ["+4 micro-batches (8 in 136.5 ms): 0-2:129, 5-7:129, 9-12:129, 20-23:129, 30:129"]
    # the first step ends 138.8 ms after its start (its four phases), the second starts 200 ms after it
    assert "  0.061 s between steps; the longest:" in out.splitlines()
    assert ("    61.2 ms before a step of 0 decode rows and 1935 prompt tokens, 32 running, 0 queued, placed after "
            "waiting up to 0.0 ms") in out.splitlines()


def test_a_step_names_how_long_the_requests_it_placed_waited(tiny_model, tmp_path):
    """One slot, two requests submitted together: the step that places the second says it waited at least from
    its submit to that step's start, the first's steps in between; steps that place nothing say 0."""
    config = EngineConfig(n_ctx=256, n_seq_max=1, n_batch=32, flash_attn="off")
    trace_path = tmp_path / "tiny.jsonl"
    prompt = tiny_model.tokenize("one two three four")
    with Engine(tiny_model, config, trace=StepTrace(trace_path)) as engine:
        params = GenerationParams(max_tokens=6, sampling=SamplingParams(temperature=0.0))
        first = engine.submit(Request(prompt, params))
        second = engine.submit(Request(prompt + [7], params))
        submitted = time.perf_counter()
        first.result(WAIT_S)
        second.result(WAIT_S)
    steps = read_trace(trace_path)
    placing = [i for i, s in enumerate(steps) if s.waited_ms > 0]
    assert placing[0] == 0 and len(placing) == 2  # the first step placed the first, a later one the second
    later = steps[placing[1]]
    assert placing[1] >= 6 and later.prompt_tokens > 0  # after the first's six tokens, with the second's prompt
    assert later.waited_ms >= 1e3 * (later.t_s - submitted)
