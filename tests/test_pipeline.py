"""The DAG pipeline: outputs against recompute, validation before allocation, failures, watermark start."""

from __future__ import annotations

import threading

import pytest

import kvrt.branching.pipeline
from kvrt.branching.pipeline import BudgetError, CycleError, DependencyFailed, NodeFailed, Pipeline, PipelineError
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.engine.model import Model
from kvrt.errors import KvrtError

TEXT = "The quick brown fox jumps over the lazy dog. " * 12
SHORT = GenerationParams(max_tokens=6)


def recompute(model: Model, doc: list[int], prompt: str, params: GenerationParams) -> list[int]:
    with Context(model, n_ctx=1024, n_batch=16, n_ubatch=16) as ctx:
        prefill(ctx, doc, logits_last=False)
        return generate(ctx, model.tokenize(prompt, add_special=False), params).tokens


def test_branches_and_functions_produce_recomputed_outputs_with_timings(tiny_model):
    doc = tiny_model.tokenize(TEXT)
    pipe = Pipeline(tiny_model, n_ctx=1024, n_batch=16)
    pipe.document("doc", TEXT)
    pipe.branch("overview", " Summary:", after="doc", params=SHORT)
    pipe.branch("obligations", " Rules:", after="doc", params=SHORT)
    pipe.node("report", lambda out: (out["overview"].text, out["obligations"].text), deps=["overview", "obligations"])
    progress: list[tuple[str, int, int]] = []
    result = pipe.run(progress=lambda *event: progress.append(event))
    assert result.ok
    assert result.outputs["doc"] == len(doc)
    assert result.outputs["overview"].tokens == recompute(tiny_model, doc, " Summary:", SHORT)
    assert result.outputs["obligations"].tokens == recompute(tiny_model, doc, " Rules:", SHORT)
    assert result.outputs["report"] == (result.outputs["overview"].text, result.outputs["obligations"].text)
    assert progress[-1] == ("doc", len(doc), len(doc)) and len(progress) >= len(doc) // 16
    assert result.timings_ms["doc"]["prefill_ms"] > 0  # SwarmKV reported 0 here
    for name in ("overview", "obligations"):
        timing = result.timings_ms[name]
        assert timing["activation_ms"] > 0 and timing["start_ms"] <= timing["end_ms"]


@pytest.mark.parametrize("mark", [1, 37, 48])
def test_watermark_branch_starts_before_the_prefill_ends(tiny_model, mark):
    """A branch needing K tokens completes while the rest of the document is still being prefilled,
    at any K (37 is not a multiple of n_batch=16), and sees exactly the first K tokens."""
    doc = tiny_model.tokenize(TEXT)
    branch_done = threading.Event()
    waited = []

    def progress(_name: str, done: int, _total: int) -> None:
        if done > mark and not waited:  # hold the prefill after the watermark until the branch finishes
            waited.append(branch_done.wait(timeout=60))

    pipe = Pipeline(tiny_model, n_ctx=1024, n_batch=16)
    pipe.document("doc", doc)
    pipe.branch("early", " Q:", after="doc", params=SHORT, need_tokens=mark)
    pipe.node("signal", lambda out: branch_done.set(), deps=["early"])
    pipe.branch("late", " Q:", after="doc", params=SHORT)
    result = pipe.run(progress=progress)
    assert waited == [True]
    assert result.outputs["early"].tokens == recompute(tiny_model, doc[:mark], " Q:", SHORT)
    assert result.outputs["late"].tokens == recompute(tiny_model, doc, " Q:", SHORT)
    assert set(result.timings_ms["doc"]["watermark_ms"]) == {mark, len(doc)}


def test_cycle_is_refused_naming_the_edge(tiny_model):
    pipe = Pipeline(tiny_model)
    pipe.node("a", lambda out: 1, deps=["c"])
    pipe.node("b", lambda out: 1, deps=["a"])
    pipe.node("c", lambda out: 1, deps=["b"])
    with pytest.raises(CycleError, match="closes a cycle") as info:
        pipe.run()
    assert info.value.edge == ("b", "a")  # b depends on a, found while walking a -> c -> b
    assert info.value.cycle == ["a", "c", "b", "a"]


def test_malformed_graphs_are_refused(tiny_model):
    pipe = Pipeline(tiny_model)
    pipe.node("a", lambda out: 1, deps=["missing"])
    with pytest.raises(PipelineError, match="'a' depends on 'missing', which does not exist"):
        pipe.run()
    pipe = Pipeline(tiny_model)
    pipe.node("f", lambda out: 1)
    pipe.branch("b", "x", after="f")
    with pytest.raises(PipelineError, match="must follow a document"):
        pipe.run()
    with pytest.raises(PipelineError, match="already exists"):
        pipe.node("f", lambda out: 2)
    with pytest.raises(PipelineError, match=r"need_tokens 0 is outside \[1, "):
        pipe.branch("c", "x", after="f", need_tokens=0)


def test_budget_is_checked_before_any_allocation(tiny_model, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("a context pool was created before the budget check")

    monkeypatch.setattr(kvrt.branching.pipeline, "ContextPool", no_allocation)
    doc = tiny_model.tokenize(TEXT)
    pipe = Pipeline(tiny_model, n_ctx=512)
    pipe.document("doc", doc)
    pipe.branch("big", " Summary:", after="doc", params=GenerationParams(max_tokens=200))
    prompt = len(tiny_model.tokenize(" Summary:", add_special=False))
    expected = rf"prefix {len(doc)} \+ prompt {prompt} \+ max_tokens 200 = {len(doc) + prompt + 200} tokens > n_ctx=512"
    with pytest.raises(BudgetError, match=expected):
        pipe.run()
    small = Pipeline(tiny_model, n_ctx=256)
    small.document("doc", doc)
    with pytest.raises(BudgetError, match=rf"document 'doc' has {len(doc)} tokens > n_ctx=256"):
        small.run()
    pipe = Pipeline(tiny_model, n_ctx=1024)
    pipe.document("doc", doc)
    pipe.branch("greedy", " Q:", after="doc", need_tokens=len(doc) + 1)
    with pytest.raises(BudgetError, match=rf"first {len(doc) + 1} tokens of 'doc', which has only {len(doc)}"):
        pipe.run()


def test_failures_propagate_to_dependents_and_spare_the_rest(tiny_model, monkeypatch):
    doc = tiny_model.tokenize(TEXT)
    bad = doc[:21]
    real_prefill = kvrt.branching.pipeline.prefill

    def prefill_failing_on_bad(ctx, tokens, **kwargs):
        if list(tokens) == bad:
            raise KvrtError("injected prefill failure")
        return real_prefill(ctx, tokens, **kwargs)

    monkeypatch.setattr(kvrt.branching.pipeline, "prefill", prefill_failing_on_bad)
    pipe = Pipeline(tiny_model, n_ctx=1024, n_batch=16)
    pipe.document("good", doc)
    pipe.document("bad", bad)  # fails inside the prefill
    pipe.branch("fine", " Q:", after="good", params=SHORT)
    pipe.branch("orphan", " Q:", after="bad", params=SHORT)
    pipe.node("crash", lambda out: 1 / 0, deps=["fine"])
    pipe.node("downstream", lambda out: "never", deps=["crash"])
    pipe.node("sibling", lambda out: out["fine"].text.upper(), deps=["fine"])
    with pytest.raises(NodeFailed) as info:
        pipe.run()
    result = info.value.result
    assert set(result.errors) == {"bad", "orphan", "crash", "downstream"}
    assert isinstance(result.errors["bad"], KvrtError) and "injected" in str(result.errors["bad"])
    assert isinstance(result.errors["orphan"], DependencyFailed)
    assert result.errors["orphan"].__cause__ is result.errors["bad"]
    assert isinstance(result.errors["crash"], ZeroDivisionError)
    assert isinstance(result.errors["downstream"], DependencyFailed)
    assert "'crash' failed: ZeroDivisionError" in str(result.errors["downstream"])
    assert result.outputs["fine"].tokens == recompute(tiny_model, doc, " Q:", SHORT)  # nothing else corrupted
    assert result.outputs["sibling"] == result.outputs["fine"].text.upper()
    again = pipe.run(raise_errors=False)  # the pipeline can run again and returns the same verdicts
    assert set(again.errors) == set(result.errors) and again.outputs["fine"].tokens == result.outputs["fine"].tokens


@pytest.mark.parametrize("source, reason", [
    (b"bytes", "must be text"), (None, "must be text"), ("", "is empty"), ([], "is empty"),
    ("\ud800", "cannot be encoded as UTF-8"), ([1, 10**6], "outside the vocabulary"), ([1.5], "must be a token id"),
], ids=repr)
def test_a_bad_document_is_refused_when_it_is_added(tiny_model, source, reason):
    pipe = Pipeline(tiny_model)
    with pytest.raises(PipelineError, match=rf"document 'd'.*{reason}|{reason}.*document 'd'"):
        pipe.document("d", source)
    pipe.document("d", "fine")  # nothing half-added under that name


@pytest.mark.parametrize("call, reason", [
    (lambda p: p.branch("b", b"x", after="d"), "must be text"),
    (lambda p: p.branch("b", "", after="d"), "prompt is empty"),
    (lambda p: p.branch("b", "x", after="d", params={"max_tokens": 2}), "GenerationParams"),
    (lambda p: p.branch("b", "x", after="d", need_tokens=2.5), "need_tokens"),
    (lambda p: p.branch("b", "x", after="d", need_tokens=True), "need_tokens"),
    (lambda p: p.node("f", "not callable"), "callable"),
    (lambda p: p.node("f", len, deps="d"), "deps"),
    (lambda p: p.node("", len), "non-empty name"),
    (lambda p: p.node(7, len), "name"),
], ids=["bytes-prompt", "empty-prompt", "params", "float-need", "bool-need", "fn", "str-deps", "empty-name",
        "int-name"])
def test_bad_nodes_are_refused_as_pipeline_errors(tiny_model, call, reason):
    pipe = Pipeline(tiny_model)
    pipe.document("d", "The document.")
    with pytest.raises(PipelineError, match=reason):
        call(pipe)
    assert list(pipe._nodes) == ["d"]


@pytest.mark.parametrize("kwargs, reason", [
    ({"max_workers": 0}, "max_workers"), ({"max_workers": 2.0}, "max_workers"), ({"n_batch": "512"}, "n_batch"),
    ({"host_pool": "pool"}, "host_pool"),
], ids=repr)
def test_bad_pipeline_settings_are_refused(tiny_model, kwargs, reason):
    with pytest.raises(PipelineError, match=reason):
        Pipeline(tiny_model, **kwargs)


DEEP = 5000  # past Python's recursion limit: the checks and the scheduling must not recurse


def test_a_deep_chain_declared_backwards_runs_in_order(tiny_model):
    pipe = Pipeline(tiny_model, max_workers=2)
    for i in range(DEEP):  # node i depends on node i + 1, declared after it
        pipe.node(f"n{i}", (lambda out, i=i: out[f"n{i + 1}"] + 1) if i < DEEP - 1 else (lambda out: 0),
                  deps=[f"n{i + 1}"] if i < DEEP - 1 else [])
    result = pipe.run()
    assert result.outputs["n0"] == DEEP - 1 and len(result.outputs) == DEEP


def test_a_deep_chain_fails_every_dependent_of_its_bottom(tiny_model):
    pipe = Pipeline(tiny_model, max_workers=2)

    def boom(out):
        raise ValueError("bottom")

    for i in range(DEEP):
        pipe.node(f"n{i}", boom if i == DEEP - 1 else (lambda out: 1), deps=[f"n{i + 1}"] if i < DEEP - 1 else [])
    result = pipe.run(raise_errors=False)
    assert not result.outputs and len(result.errors) == DEEP
    assert isinstance(result.errors["n0"], DependencyFailed)


def test_a_long_cycle_is_a_cycle_error(tiny_model):
    pipe = Pipeline(tiny_model)
    for i in range(DEEP):
        pipe.node(f"n{i}", lambda out: 1, deps=[f"n{(i + 1) % DEEP}"])
    with pytest.raises(CycleError) as info:
        pipe.run()
    assert info.value.cycle == [f"n{i % DEEP}" for i in range(DEEP + 1)]
    assert info.value.edge == (f"n{DEEP - 1}", "n0")
