"""Every fan-out mode against llama-cpp-python evaluating document + question from scratch, greedy, on the demo model.

The reference is a ``llama_cpp.Llama`` (opened with this machine's extra-buffer-type
verdict, like kvrt's model), reset between branches, that evaluates the document (in the
segments kvrt's prefill cut it into), then asks ``Llama.generate`` to continue document +
question: its prefix match evaluates the question as one call, then samples each token
with its greedy sampler. Both sides use the same settings (``SETTINGS``).

What each mode promises (kvrt.branching.branches' docstring):
- ``exact=True``, shared or isolated: token-identical;
- isolated, a restore from a disk snapshot, Pipeline watermark branches: token-identical
  while the document fits the model's sliding window; past it, a restored branch agrees
  up to its first near-tie (the branch that continues in the prefill context stays exact);
- shared with ``exact=False``: agrees up to its first near-tie; one branch alone is exact.
"Near-tie": where the outputs first differ, the reference's top two logits are within
``TIE`` of each other. A branch that read the wrong cells would differ where the reference
is sure of its token, far above that.

``exact=True`` is promised on every CPU kernel set: :func:`test_exact_on_every_cpu_kernel_set`
runs the two exact tests again in a child process per set this machine can force
(:data:`KERNEL_SETS`: one thread, llama.cpp's tiled quantized matmul off or forced, its op
fusion off, the extra buffer types the other way from this machine's verdict); the
environment variables must be set before llama.cpp is loaded, hence the child.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvrt.branching.branches import Branch, fanout, isolated_params
from kvrt.branching.pipeline import Pipeline
from kvrt.branching.runner import run_isolated
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, prefill
from kvrt.engine.model import Model
from kvrt.state.contextpool import ContextPool
from kvrt.state.snapshot import Snapshot
from kvrt.system.cpu import EXTRA_BUFTS_ENV, llama_cpp_llama, safe_extra_bufts
from kvrt_bench._peer import GreedyReference, greedy_reference

KERNEL_SET_ENV = "KVRT_TEST_KERNEL_SET"  # set in a kernel set's child run
THREADS_ENV = "KVRT_TEST_THREADS"
N_THREADS = int(os.environ.get(THREADS_ENV, "2"))
KERNEL_SETS = {  # name -> the environment that forces it (read once, when llama.cpp's CPU backend first needs it)
    "threads-1": {THREADS_ENV: "1"},
    "tiled-mm-off": {"GGML_CPU_TILED_MM": "0"},  # quantized matmuls by ggml's vec_dot, not the tiled kernel
    "tiled-mm-forced": {"GGML_CPU_TILED_MM_FORCE": "1"},  # the tiled kernel even where it is not profitable
    "fusion-off": {"GGML_CPU_DISABLE_FUSION": "1"},
    "extra-bufts-on": {EXTRA_BUFTS_ENV: "on"},  # AMX / repacked weights
    "extra-bufts-off": {EXTRA_BUFTS_ENV: "off"},
}
EXACT_TESTS = "test_shared_exact_is_token_identical or test_isolated_exact_is_token_identical"
SETTINGS = {"n_batch": 512, "n_threads": N_THREADS, "flash_attn": "off"}
LONG_DOC = 934
MAX_TOKENS = 16
TIE = 1.0  # logits
QUESTIONS = [
    "\n\nIn one sentence, the document above is about",
    "\n\nQuestion: who is Google in this agreement?\nAnswer:",
    "\n\nThe obligations it places on distributors are:\n1.",
    "\n\nSummary of section 3:",
]
BRANCHES = [Branch(q, GenerationParams(max_tokens=MAX_TOKENS), f"q{i}") for i, q in enumerate(QUESTIONS)]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(demo_model_path: Path) -> Iterator[object]:
    llama = llama_cpp_llama(demo_model_path, n_ctx=2048, n_batch=SETTINGS["n_batch"], n_ubatch=SETTINGS["n_batch"],
                            n_threads=N_THREADS, n_threads_batch=N_THREADS, flash_attn=False, verbose=False)
    yield llama
    llama.close()


def first_divergence(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first token where the two outputs differ (one ending early counts), None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def assert_near_tie_only(got: Sequence[list[int]], refs: Sequence[GreedyReference]) -> int:
    """Each output equals its reference up to a step where the reference's top two logits are within TIE; returns
    how many outputs differ."""
    diverged = 0
    for i, (tokens, ref) in enumerate(zip(got, refs)):
        k = first_divergence(tokens, ref.tokens)
        if k is not None:
            diverged += 1
            assert ref.margins[k] < TIE, (f"branch {i} differs from the reference at token {k}, where the reference's "
                                          f"top two logits are {ref.margins[k]:.3f} apart (not a near-tie)")
    return diverged


@pytest.fixture(scope="module")
def window(demo_model: Model) -> int:
    value = demo_model.meta(f"{demo_model.meta('general.architecture')}.attention.sliding_window")
    assert value is not None, "the demo model is expected to have sliding-window layers"
    return int(value)


@pytest.fixture(scope="module")
def long_doc(demo_model: Model, window: int) -> list[int]:
    from kvrt.modelfiles.demo_model import license_terms_text

    text = license_terms_text()
    tokens = demo_model.tokenize(text[text.find("Gemma Terms of Use"):])[:LONG_DOC]
    assert len(tokens) == LONG_DOC > window
    return tokens


@pytest.fixture(scope="module")
def short_doc(long_doc: list[int], window: int) -> list[int]:
    """A document whose branches stay inside the sliding window (nothing of it is ever masked)."""
    return long_doc[:window - 64 - MAX_TOKENS]


@pytest.fixture(scope="module")
def prompts(demo_model: Model) -> list[list[int]]:
    return [demo_model.tokenize(q, add_special=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def long_refs(llm, long_doc, prompts) -> list[GreedyReference]:
    return [greedy_reference(llm, [long_doc], p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def short_refs(llm, short_doc, prompts, window) -> list[GreedyReference]:
    assert all(len(short_doc) + len(p) + MAX_TOKENS <= window for p in prompts)
    return [greedy_reference(llm, [short_doc], p, MAX_TOKENS) for p in prompts]


def tokens_of(result) -> list[list[int]]:
    return [b.completion.tokens for b in result.branches]


@pytest.fixture(scope="module")
def isolated_long(demo_model, long_doc):
    return fanout(demo_model, long_doc, BRANCHES, mode="isolated", **SETTINGS)


def test_reference_is_not_degenerate(long_refs, short_refs):
    """The branches produce distinct, full-length outputs: a comparison against them can fail."""
    for refs in (long_refs, short_refs):
        assert len({tuple(r.tokens) for r in refs}) == len(refs)
        assert all(len(r.tokens) >= MAX_TOKENS // 2 for r in refs)


def test_shared_exact_is_token_identical(demo_model, long_doc, long_refs):
    result = fanout(demo_model, long_doc, BRANCHES, mode="shared", exact=True, **SETTINGS)
    assert (result.mode, result.exact, result.fork_ms) == ("shared", True, 0.0)
    assert tokens_of(result) == [r.tokens for r in long_refs]


def test_shared_exact_is_the_auto_choice_and_exact_with_a_pool(demo_model, long_doc, long_refs):
    from kvrt.branching.branches import shared_params

    with ContextPool(demo_model, shared_params(2048, 2, **SETTINGS)) as pool:
        result = fanout(demo_model, long_doc, BRANCHES[:2], exact=True, pool=pool)
    assert result.mode == "shared"
    assert tokens_of(result) == [r.tokens for r in long_refs[:2]]


def test_isolated_exact_is_token_identical(demo_model, long_doc, long_refs):
    """exact=True in isolated mode takes no snapshot: every branch continues in the prefill context, trimmed back."""
    result = fanout(demo_model, long_doc, BRANCHES, mode="isolated", exact=True, **SETTINGS)
    assert (result.mode, result.exact, result.fork_ms, result.contexts_created) == ("isolated", True, 0.0, 1)
    assert tokens_of(result) == [r.tokens for r in long_refs]


def test_shared_batched_agrees_up_to_near_ties(demo_model, long_doc, long_refs):
    result = fanout(demo_model, long_doc, BRANCHES, mode="shared", exact=False, **SETTINGS)
    assert (result.mode, result.exact) == ("shared", False)
    assert_near_tie_only(tokens_of(result), long_refs)


def test_shared_batched_one_branch_is_exact(demo_model, long_doc, long_refs):
    """With no sibling in the batch or the cache, batched decode is the from-scratch computation."""
    result = fanout(demo_model, long_doc, BRANCHES[2:3], mode="shared", exact=False, **SETTINGS)
    assert tokens_of(result) == [long_refs[2].tokens]


def test_isolated_past_the_window(isolated_long, long_refs):
    """The first branch continues in the prefill context: exact; restored ones agree up to near-ties."""
    got = tokens_of(isolated_long)
    assert got[0] == long_refs[0].tokens
    assert_near_tie_only(got[1:], long_refs[1:])


def test_isolated_within_the_window_is_token_identical(demo_model, short_doc, short_refs):
    result = fanout(demo_model, short_doc, BRANCHES, mode="isolated", **SETTINGS)
    assert tokens_of(result) == [r.tokens for r in short_refs]


@pytest.mark.parametrize("which", ["short", "long"])
def test_restore_from_a_disk_snapshot(demo_model, tmp_path, which, request):
    """A disk snapshot loaded into a new pool's contexts continues like the in-memory restore of isolated mode
    (the same bytes), and like the reference within the window."""
    doc = request.getfixturevalue(f"{which}_doc")
    path = tmp_path / "doc.kvs"
    params = isolated_params(len(doc) + 64 + MAX_TOKENS, n_batch=SETTINGS["n_batch"], n_threads=N_THREADS)
    with Context(demo_model, params) as ctx:
        prefill(ctx, doc, logits_last=False)
        with Snapshot.capture(ctx, tokens=doc) as snapshot:
            snapshot.save(path)
    with ContextPool(demo_model, params) as pool, Snapshot.load(path) as snapshot:
        got = [run_isolated(snapshot, b, pool).completion.tokens for b in BRANCHES]
    if which == "short":
        assert got == [r.tokens for r in request.getfixturevalue("short_refs")]
    else:
        assert got[1:] == tokens_of(request.getfixturevalue("isolated_long"))[1:]
        assert_near_tie_only(got, request.getfixturevalue("long_refs"))


def test_pipeline_watermark_branches(demo_model, llm, long_doc, short_doc, short_refs, long_refs, prompts):
    """A branch at a watermark inside the window is exact; one at the document's end agrees up to near-ties. The
    reference evaluates the segments the prefill was cut into (at every watermark)."""
    mark = len(short_doc)
    pipe = Pipeline(demo_model, n_ctx=2048, max_workers=2, **SETTINGS)
    pipe.document("doc", long_doc)
    for i, branch in enumerate(BRANCHES):
        pipe.branch(f"early{i}", branch.prompt, after="doc", params=branch.params, need_tokens=mark)
    pipe.branch("late", BRANCHES[1].prompt, after="doc", params=BRANCHES[1].params)
    result = pipe.run()
    assert [result.outputs[f"early{i}"].tokens for i in range(len(BRANCHES))] == [r.tokens for r in short_refs]
    late = greedy_reference(llm, [long_doc[:mark], long_doc[mark:]], prompts[1], MAX_TOKENS)
    assert_near_tie_only([result.outputs["late"].tokens], [late])


def test_exact_is_token_identical_with_flash_attention_on(demo_model, demo_model_path, long_doc, prompts):
    """exact=True needs no particular flash_attn, only the same on both sides."""
    llama = llama_cpp_llama(demo_model_path, n_ctx=2048, n_batch=SETTINGS["n_batch"], n_ubatch=SETTINGS["n_batch"],
                            n_threads=N_THREADS, n_threads_batch=N_THREADS, flash_attn=True, verbose=False)
    try:
        refs = [greedy_reference(llama, [long_doc], p, MAX_TOKENS).tokens for p in prompts[:2]]
    finally:
        llama.close()
    settings = {**SETTINGS, "flash_attn": "on"}
    for mode in ("shared", "isolated"):
        result = fanout(demo_model, long_doc, BRANCHES[:2], mode=mode, exact=True, **settings)
        assert tokens_of(result) == refs, mode


@pytest.mark.skipif(bool(os.environ.get(KERNEL_SET_ENV)), reason="inside a kernel set's child run")
@pytest.mark.parametrize("kernel_set", sorted(KERNEL_SETS))
def test_exact_on_every_cpu_kernel_set(kernel_set: str, demo_model_path: Path):
    """The exact tests pass in a child process forced onto ``kernel_set``: the reference and kvrt both run on it."""
    env = KERNEL_SETS[kernel_set]
    verdict = safe_extra_bufts()
    bufts = env.get(EXTRA_BUFTS_ENV)
    if bufts == ("on" if verdict.use_extra_bufts else "off"):
        pytest.skip(f"the kernels this run already uses ({EXTRA_BUFTS_ENV} decided {bufts}: {verdict.reason})")
    if bufts == "on":
        pytest.skip(f"kvrt keeps llama.cpp's CPU extra buffer types off on this CPU ({verdict.reason})")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", EXACT_TESTS,
                           __file__], cwd=Path(__file__).parent.parent, env={**os.environ, **env,
                                                                             KERNEL_SET_ENV: kernel_set},
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
