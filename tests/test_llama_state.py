"""kvrt snapshots <-> llama-cpp-python states: each side continues the other's state token-identically.

References: kvrt restoring its own snapshot into a fresh context, and a ``llama_cpp.Llama``
continuing its own evaluation, both greedy with the same settings on the demo model. The
document stays inside the model's sliding window, where a restore keeps the prefill's
layout (past it neither kvrt's restores nor ``Llama.load_state`` do; see
kvrt.state.llama_state).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.engine.model import Model
from kvrt.state.llama_state import (
    LlamaStateError,
    snapshot_from_llama_state,
    snapshot_to_llama_state,
)
from kvrt.state.snapshot import Snapshot, SnapshotMismatch, token_hash
from kvrt.system.cpu import llama_cpp_llama

DOC_TOKENS = 300
MAX_TOKENS = 16
PARAMS = ContextParams(n_ctx=1024, n_threads=2, flash_attn="off")
PROMPT = "\n\nQuestion: who is Google in this agreement?\nAnswer:"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(demo_model_path: Path) -> Iterator[object]:
    llama = llama_cpp_llama(demo_model_path, n_ctx=1024, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False)
    yield llama
    llama.close()


@pytest.fixture(scope="module")
def doc(demo_model: Model) -> list[int]:
    from kvrt.modelfiles.demo_model import license_terms_text

    text = license_terms_text()
    tokens = demo_model.tokenize(text[text.find("Gemma Terms of Use"):])[:DOC_TOKENS]
    window = int(demo_model.meta("gemma3.attention.sliding_window") or 0)
    assert len(tokens) + 64 + MAX_TOKENS <= window
    return tokens


@pytest.fixture(scope="module")
def prompt(demo_model: Model) -> list[int]:
    return demo_model.tokenize(PROMPT, add_special=False)


@pytest.fixture(scope="module")
def snapshot(demo_model, doc) -> Iterator[Snapshot]:
    with Context(demo_model, PARAMS) as ctx:
        prefill(ctx, doc, logits_last=False)
        snap = Snapshot.capture(ctx, tokens=doc)
    yield snap
    snap.release()


def kvrt_continues(model: Model, snapshot: Snapshot, prompt: list[int]) -> list[int]:
    with Context(model, PARAMS) as ctx:
        snapshot.restore(ctx)
        return generate(ctx, prompt, GenerationParams(max_tokens=MAX_TOKENS)).tokens


def llama_continues(llm, history: list[int], prompt: list[int]) -> tuple[list[int], list[int]]:
    """Greedy tokens of ``Llama.generate`` after ``history`` (already held), and the sizes of its evaluations."""
    import llama_cpp

    evaluated: list[int] = []
    evaluate = llm.eval
    llm.eval = lambda tokens: (evaluated.append(len(tokens)), evaluate(tokens))[1]
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out: list[int] = []
    steps = llm.generate(history + prompt, temp=0.0)
    try:
        for token in steps:
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            out.append(int(token))
            if len(out) == MAX_TOKENS:
                break
    finally:
        steps.close()
        del llm.eval
    return out, evaluated


@pytest.fixture(scope="module")
def kvrt_reference(demo_model, snapshot, prompt) -> list[int]:
    tokens = kvrt_continues(demo_model, snapshot, prompt)
    assert len(tokens) >= MAX_TOKENS // 2
    return tokens


def test_a_kvrt_snapshot_continues_in_a_llama_like_in_kvrt(llm, snapshot, doc, prompt, kvrt_reference):
    llm.reset()
    before = (llm.n_tokens, llm.input_ids.copy())
    state = snapshot_to_llama_state(snapshot, llm, doc)
    assert (llm.n_tokens, llm.input_ids.tolist()) == (before[0], before[1].tolist())  # the Llama is not changed
    assert state.n_tokens == len(doc) and state.input_ids[:len(doc)].tolist() == doc
    llm.load_state(state)
    tokens, evaluated = llama_continues(llm, doc, prompt)
    assert evaluated[0] == len(prompt)  # the document came from the state, not a re-evaluation
    assert tokens == kvrt_reference


def test_a_llama_state_continues_in_kvrt_like_in_the_llama(llm, demo_model, doc, prompt):
    llm.reset()
    llm.eval(doc)
    state = llm.save_state()
    want, _ = llama_continues(llm, doc, prompt)
    with snapshot_from_llama_state(state, demo_model) as snap:
        assert (snap.n_tokens, snap.tokens_hash, snap.layout.flash_attn) == (len(doc), token_hash(doc), "off")
        assert kvrt_continues(demo_model, snap, prompt) == want


def test_cells_past_n_tokens_are_dropped(llm, demo_model, doc, prompt, kvrt_reference):
    """After generating, a Llama told it holds only the document still has the generated cells: not imported."""
    llm.reset()
    llm.eval(doc + prompt + [236761] * 5)
    llm.n_tokens = len(doc)
    with snapshot_from_llama_state(llm.save_state(), demo_model) as snap:
        assert snap.n_tokens == len(doc)
        assert kvrt_continues(demo_model, snap, prompt) == kvrt_reference


def test_states_through_llama_cpp_caches(llm, demo_model, snapshot, doc, prompt, kvrt_reference, tmp_path):
    """A converted state serves a Llama's prompt cache (create_completion loads it) and survives LlamaDiskCache."""
    from llama_cpp import LlamaDiskCache, LlamaRAMCache

    ram = LlamaRAMCache()
    ram[doc] = snapshot_to_llama_state(snapshot, llm, doc)
    llm.reset()
    llm.set_cache(ram)
    try:
        evaluated: list[int] = []
        evaluate = llm.eval
        llm.eval = lambda tokens: (evaluated.append(len(tokens)), evaluate(tokens))[1]
        completion = llm.create_completion(doc + prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        del llm.eval
    finally:
        llm.set_cache(None)
    assert evaluated[0] == len(prompt)
    assert completion["choices"][0]["text"] == demo_model.detokenize(kvrt_reference)
    disk = LlamaDiskCache(str(tmp_path / "cache"))
    disk[doc] = ram[doc]
    with snapshot_from_llama_state(disk[doc], demo_model) as snap:
        assert kvrt_continues(demo_model, snap, prompt) == kvrt_reference


# -- refusals --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_state(llm, doc):
    llm.reset()
    llm.eval(doc)
    return llm.save_state()


def test_truncated_state_bytes_are_refused(llama_state, demo_model):
    import copy

    short = copy.copy(llama_state)
    short.llama_state = llama_state.llama_state[:-1000]
    with pytest.raises(LlamaStateError, match="truncated or altered"):
        snapshot_from_llama_state(short, demo_model)
    short.llama_state_size = len(short.llama_state)  # consistent fields, missing bytes: llama.cpp notices
    with pytest.raises(LlamaStateError, match="llama.cpp refused the state"):
        snapshot_from_llama_state(short, demo_model)


def test_a_state_saved_with_the_other_v_layout_is_refused(llama_state, demo_model):
    with pytest.raises(LlamaStateError, match="flash_attn other than 'on'"):
        snapshot_from_llama_state(llama_state, demo_model, flash_attn="on")


def test_states_of_another_model_are_refused(llama_state, tiny_model, tiny_model_path, snapshot, doc):
    with pytest.raises(LlamaStateError, match=f"vocabulary of {262144} tokens saved it.*has {tiny_model.n_vocab}"):
        snapshot_from_llama_state(llama_state, tiny_model)
    tiny_llm = llama_cpp_llama(tiny_model_path, n_ctx=512, n_threads=1, verbose=False)
    try:
        with pytest.raises(SnapshotMismatch, match="cannot be restored into"):
            snapshot_to_llama_state(snapshot, tiny_llm, doc)
    finally:
        tiny_llm.close()


def test_tokens_must_be_the_snapshots(snapshot, llm, doc):
    with pytest.raises(LlamaStateError, match=f"{len(doc) - 1} token ids given, the snapshot holds {len(doc)}"):
        snapshot_to_llama_state(snapshot, llm, doc[:-1])
    with pytest.raises(LlamaStateError, match="not the ones the snapshot was captured with"):
        snapshot_to_llama_state(snapshot, llm, doc[:-1] + [doc[-1] + 1])
    with pytest.raises(LlamaStateError, match="sequence of int"):
        snapshot_to_llama_state(snapshot, llm, "text")


def test_wrong_kinds_are_refused(snapshot, llm, demo_model, doc, llama_state):
    with pytest.raises(LlamaStateError, match="expected a kvrt Snapshot"):
        snapshot_to_llama_state(llama_state, llm, doc)
    with pytest.raises(LlamaStateError, match="expected a llama_cpp.Llama"):
        snapshot_to_llama_state(snapshot, demo_model, doc)
    with pytest.raises(LlamaStateError, match="expected a llama_cpp.LlamaState"):
        snapshot_from_llama_state(snapshot, demo_model)
    with pytest.raises(LlamaStateError, match="expected a kvrt Model"):
        snapshot_from_llama_state(llama_state, llm)
    with pytest.raises(LlamaStateError, match="flash_attn must be 'off' or 'on'"):
        snapshot_from_llama_state(llama_state, demo_model, flash_attn="auto")
    bad = type(llama_state)(llama_state.input_ids, llama_state.scores, 0, llama_state.llama_state,
                            llama_state.llama_state_size, llama_state.seed)
    with pytest.raises(LlamaStateError, match=r"n_tokens must be in \[1, 1024\]"):
        snapshot_from_llama_state(bad, demo_model)
    assert np.asarray(llama_state.input_ids).shape == (1024,)


def test_a_state_missing_the_windows_masked_cells_is_refused(llm, demo_model, window_doc):
    """A kvrt snapshot past the sliding window leaves out the masked cells; a Llama that loaded it saves a state
    without them, which no kvrt snapshot can hold (it needs the whole prefix)."""
    with Context(demo_model, PARAMS) as ctx:
        prefill(ctx, window_doc, logits_last=False)
        with Snapshot.capture(ctx, tokens=window_doc) as snap:
            llm.load_state(snapshot_to_llama_state(snap, llm, window_doc))
    with pytest.raises(LlamaStateError, match="cells start at position [1-9][0-9]*, not 0"):
        snapshot_from_llama_state(llm.save_state(), demo_model)


@pytest.fixture(scope="module")
def window_doc(demo_model: Model) -> list[int]:
    """A document longer than the model's sliding window."""
    from kvrt.modelfiles.demo_model import license_terms_text

    text = license_terms_text()
    tokens = demo_model.tokenize(text[text.find("Gemma Terms of Use"):])[:600]
    assert len(tokens) > int(demo_model.meta("gemma3.attention.sliding_window") or 0)
    return tokens
