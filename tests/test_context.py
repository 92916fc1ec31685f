"""Decoding, logits, sequence state and the errors a context must turn into exceptions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvrt import Batch, Context, Model, Sampler
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.errors import ClosedError, ContextError, DecodeError, KvrtError, StateError

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6
CONTINUATION = " And then it ran far away."


def test_logits_match_llama_cpp_python(tiny_model_path: Path, tiny_model: Model) -> None:
    """Same model, prompt and context settings through llama-cpp-python's high-level API."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(tiny_model_path), n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2,
                          n_gpu_layers=tiny_model.params.n_gpu_layers,  # the same device as kvrt's (GPU: all layers)
                          flash_attn=False, logits_all=True, verbose=False)
    tokens = llm.tokenize(PROMPT.encode())
    llm.eval(tokens)
    reference = np.asarray(llm.scores[len(tokens) - 1])
    llm.close()
    with Context(tiny_model, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2, flash_attn="off") as ctx:
        ours = ctx.logits(prefill(ctx, tiny_model.tokenize(PROMPT)))
    # llama-cpp-python asks for every row's logits, which changes the output matmul's shape,
    # so agreement is to float32 rounding, not to the bit.
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-4 * np.abs(reference).max())
    assert int(np.argmax(ours)) == int(np.argmax(reference))


def _continue(ctx: Context, tokens: list[int]) -> np.ndarray:
    return ctx.logits(prefill(ctx, tokens))


def test_sequence_state_restore_is_bit_identical_to_recompute(tiny_model: Model) -> None:
    prompt = tiny_model.tokenize(PROMPT)
    cont = tiny_model.tokenize(CONTINUATION, add_special=False)
    with Context(tiny_model, n_ctx=512) as source:
        prefill(source, prompt)
        state = np.empty(source.seq_state_size(0), dtype=np.uint8)
        written = source.seq_state_get(0, state)
    assert written == state.nbytes
    with Context(tiny_model, n_ctx=512) as fresh:
        assert fresh.seq_state_set(state, 0) == state.nbytes
        assert fresh.seq_len(0) == len(prompt)
        restored = _continue(fresh, cont)
    with Context(tiny_model, n_ctx=512) as recompute:
        prefill(recompute, prompt)
        expected = _continue(recompute, cont)
    assert np.array_equal(restored, expected)


def test_restore_into_another_sequence_continues_its_positions(tiny_model: Model) -> None:
    """The state carries positions: decoding after a restore into seq 1 starts at len(prompt)."""
    prompt = tiny_model.tokenize(PROMPT)
    cont = tiny_model.tokenize(CONTINUATION, add_special=False)
    with Context(tiny_model, n_ctx=512, n_seq_max=2) as ctx:
        prefill(ctx, prompt, seq_id=0)
        state = np.empty(ctx.seq_state_size(0), dtype=np.uint8)
        ctx.seq_state_get(0, state)
        ctx.seq_state_set(state, 1)
        assert ctx.seq_len(1) == len(prompt)
        right = ctx.logits(prefill(ctx, cont, seq_id=1))
        ctx.seq_rm(1)
        ctx.seq_state_set(state, 1)
        ctx.seq_rm(1, len(prompt) - 8, -1)  # a wrong offset: eight positions missing
        wrong = ctx.logits(prefill(ctx, cont, seq_id=1, start_pos=len(prompt) - 8))
    with Context(tiny_model, n_ctx=512) as reference:
        prefill(reference, prompt)
        expected = _continue(reference, cont)
    assert np.array_equal(right, expected)
    assert not np.allclose(wrong, expected)


def test_corrupt_state_is_refused_and_sequence_left_empty(tiny_model: Model) -> None:
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, tiny_model.tokenize(PROMPT))
        state = np.empty(ctx.seq_state_size(0), dtype=np.uint8)
        ctx.seq_state_get(0, state)
        with pytest.raises(StateError):
            ctx.seq_state_set(state[: state.nbytes // 3], 0)
        assert ctx.seq_len(0) == 0


def test_state_get_into_too_small_buffer(tiny_model: Model) -> None:
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, tiny_model.tokenize(PROMPT))
        with pytest.raises(StateError, match="buffer_bytes=16"):
            ctx.seq_state_get(0, np.empty(16, dtype=np.uint8))


def test_context_larger_than_memory_is_a_clear_error(tiny_model: Model) -> None:
    with pytest.raises(ContextError, match="n_ctx"):
        Context(tiny_model, n_ctx=2**31)


def test_decoding_past_n_ctx(tiny_model: Model) -> None:
    with Context(tiny_model, n_ctx=256, n_batch=64, n_ubatch=64) as ctx:
        assert ctx.n_ctx == 256
        with pytest.raises(DecodeError, match="past n_ctx"):
            prefill(ctx, [5] * 300)
        assert ctx.seq_len(0) == 256  # the chunks that fitted stay; nothing is corrupted
        with pytest.raises(DecodeError, match="past n_ctx"):
            prefill(ctx, [5])


def test_out_of_vocabulary_token_in_a_batch(tiny_model: Model) -> None:
    with Context(tiny_model, n_ctx=64) as ctx, Batch(8) as batch:
        batch.add_sequence([5, tiny_model.n_vocab + 3], 0, 0)
        with pytest.raises(DecodeError, match="outside the vocabulary"):
            ctx.decode(batch)
        assert ctx.seq_len(0) == 0


def test_sequence_id_out_of_range(tiny_model: Model) -> None:
    with Context(tiny_model, n_ctx=64) as ctx, Batch(8) as batch:
        batch.add_sequence([5, 6], 0, 3)
        with pytest.raises(DecodeError, match="sequence id 3"):
            ctx.decode(batch)


def test_batch_overflow_is_refused() -> None:
    with Batch(4) as batch:
        with pytest.raises(KvrtError, match="overflow"):
            batch.add_sequence([1, 2, 3, 4, 5], 0, 0)


def test_sampling_a_row_without_logits_raises_instead_of_aborting(tiny_model: Model) -> None:
    with Context(tiny_model, n_ctx=64) as ctx:
        row = prefill(ctx, [1, 5, 6, 7])
        sampler = Sampler()
        assert 0 <= sampler.sample(ctx, row) < tiny_model.n_vocab
        with pytest.raises(DecodeError, match="no logits"):
            sampler.sample(ctx, row - 1)


def test_argmax_of_many_rows_is_llama_cpp_greedy_pick_of_each(tiny_model: Model) -> None:
    """Context.argmax over a batch's rows (some without logits in between) picks what llama.cpp's own
    greedy sampler picks for each row, and refuses a row without logits."""
    from kvrt.bindings import lib

    prompts = [tiny_model.tokenize(t) for t in ("Once upon a time", "The cat sat", "In a hole in the ground")]
    with Context(tiny_model, n_ctx=256, n_seq_max=3, kv_unified=True) as ctx, Batch(64) as batch:
        rows = [batch.add_sequence(p, 0, seq, logits_last=True) for seq, p in enumerate(prompts)]
        batch.add(5, len(prompts[0]), 0, logits=True)
        rows.append(batch.n_tokens - 1)
        ctx.decode(batch)
        chain = lib().llama_sampler_chain_init(lib().llama_sampler_chain_default_params())
        lib().llama_sampler_chain_add(chain, lib().llama_sampler_init_greedy())
        try:
            expected = [int(lib().llama_sampler_sample(chain, ctx.ptr, row)) for row in rows]
        finally:
            lib().llama_sampler_free(chain)
        assert ctx.argmax(rows) == expected
        assert ctx.argmax(rows[::-1]) == expected[::-1]
        assert ctx.argmax([]) == []
        with pytest.raises(DecodeError, match="no logits"):
            ctx.argmax([rows[0], rows[0] - 1])


def test_use_after_free(tiny_model: Model) -> None:
    ctx = Context(tiny_model, n_ctx=64)
    ctx.close()
    with pytest.raises(ClosedError):
        prefill(ctx, [1, 2])
    with pytest.raises(ClosedError):
        ctx.seq_state_size(0)


def test_invalid_parameters_are_refused_before_llama_cpp() -> None:
    from kvrt.engine.context_params import ContextParams

    with pytest.raises(KvrtError, match="n_ctx"):
        ContextParams(n_ctx=0)
    with pytest.raises(KvrtError, match="n_ubatch"):
        ContextParams(n_batch=64, n_ubatch=128)
    with pytest.raises(KvrtError, match="flash_attn"):
        ContextParams(flash_attn="maybe")


def test_greedy_generation_follows_the_argmax(tiny_model: Model) -> None:
    """Each greedy token is the argmax of a full recompute of everything before it, up to the float noise
    between a one-token decode and a many-token prefill (other matmul kernels on a GPU; none seen on the CPU)."""
    params = GenerationParams(max_tokens=6)
    prompt = tiny_model.tokenize("Once upon a time")
    with Context(tiny_model, n_ctx=128) as ctx:
        result = generate(ctx, prompt, params)
    assert result.finish_reason in {"length", "eog"}
    history = list(prompt)
    for token in result.tokens:
        with Context(tiny_model, n_ctx=128) as ref:
            logits = ref.logits(prefill(ref, history))
        best = int(np.argmax(logits))
        assert token == best or logits[best] - logits[token] <= 1e-3 * np.abs(logits).max(), (token, best)
        history.append(token)


def test_stop_string_is_cut(tiny_model: Model) -> None:
    with Context(tiny_model, n_ctx=128) as ctx:
        free = generate(ctx, "abc", GenerationParams(max_tokens=12))
    assert len(free.text) > 2
    stop = free.text[2:4]
    with Context(tiny_model, n_ctx=128) as ctx:
        cut = generate(ctx, "abc", GenerationParams(max_tokens=12, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert free.text.startswith(cut.text)


def test_borrowed_context_records_the_llama_parameters(tiny_model_path: Path) -> None:
    """A snapshot of a borrowed context must name its real settings (restorable into kvrt contexts)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(tiny_model_path), n_ctx=256, n_threads=1, flash_attn=False, verbose=False)
    ctx = Context.from_llama_cpp(llm)
    assert (ctx.params.flash_attn, ctx.params.n_threads) == ("off", 1)
    assert ctx.params.n_ctx == 256


def test_writes_through_a_borrowed_context_keep_the_llama_correct(tiny_model_path: Path) -> None:
    """After kvrt writes into a Llama's context, the Llama's next completion equals a fresh Llama's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    kwargs = {"n_ctx": 256, "n_threads": 1, "flash_attn": False, "verbose": False}
    fresh = llama_cpp.Llama(str(tiny_model_path), **kwargs)
    expected = fresh("The quick brown fox", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    llm = llama_cpp.Llama(str(tiny_model_path), **kwargs)
    llm("The quick brown fox", max_tokens=8, temperature=0.0)  # the Llama now caches this prefix
    ctx = Context.from_llama_cpp(llm)
    ctx.clear()
    prefill(ctx, ctx.model.tokenize("Something else entirely, written by kvrt."))
    assert llm.n_tokens == 0
    assert llm("The quick brown fox", max_tokens=8, temperature=0.0)["choices"][0]["text"] == expected


CLOSE_UNDER_DECODE = r"""
import sys, threading
from kvrt import Context, GenerationParams, generate
from kvrt.engine.model import Model
from kvrt.errors import KvrtError

model = Model(sys.argv[1])
ctx = Context(model, n_ctx=1024, n_batch=8, n_ubatch=8, flash_attn="off")
started, outcome = threading.Event(), []

def work():
    try:
        for _ in range(20):
            started.set()
            ctx.clear()
            generate(ctx, list(range(3, 400)), GenerationParams(max_tokens=200))
        outcome.append("finished")
    except KvrtError as exc:
        outcome.append(type(exc).__name__)

worker = threading.Thread(target=work)
worker.start()
started.wait()
for _ in range(1000):  # close while the other thread is somewhere inside generate (prefill of 8-token batches)
    pass
ctx.close()
worker.join()
assert outcome == ["ClosedError"], outcome
assert ctx.closed
model.close()
print("OK", outcome)
"""


def test_closing_a_context_while_another_thread_decodes_waits_for_the_decode(tiny_model_path):
    """It used to free the context under llama_decode (SIGSEGV): run in a child, so a crash fails the test."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CLOSE_UNDER_DECODE, str(tiny_model_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, (done.returncode, done.stdout, done.stderr[-3000:])
