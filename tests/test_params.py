"""Argument checking of generation and sampling: every bad value is a KvrtError naming it, before any work."""

from __future__ import annotations

import numpy as np
import pytest

from kvrt.checks import check_int, check_real, check_text, check_tokens
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import InvalidArgument, KvrtError


@pytest.mark.parametrize("bad", [2.5, True, False, "3", None, 0, -1, 2**31], ids=repr)
def test_max_tokens_must_be_a_positive_int(bad):
    with pytest.raises(InvalidArgument, match="max_tokens"):
        GenerationParams(max_tokens=bad)


def test_max_tokens_accepts_numpy_integers_as_plain_ints():
    params = GenerationParams(max_tokens=np.int64(5))
    assert params.max_tokens == 5 and type(params.max_tokens) is int


@pytest.mark.parametrize("stop", ["\n", ("",), (None,), (b"x",), ("\ud800",), 5], ids=repr)
def test_stop_must_be_non_empty_strings_in_a_tuple_or_list(stop):
    with pytest.raises(InvalidArgument, match="stop"):
        GenerationParams(stop=stop)


def test_stop_as_a_list_becomes_a_tuple():
    assert GenerationParams(stop=["a", "b"]).stop == ("a", "b")


def test_sampling_must_be_sampling_params():
    with pytest.raises(InvalidArgument, match="sampling"):
        GenerationParams(sampling={"temperature": 1.0})  # type: ignore[arg-type]


@pytest.mark.parametrize("field, bad", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.5), ("temperature", "1"),
    ("temperature", True), ("top_k", 2.0), ("top_k", -1), ("top_k", True), ("top_p", float("nan")),
    ("top_p", 0.0), ("top_p", "0.9"), ("min_p", 1.0), ("min_p", float("nan")), ("seed", -1), ("seed", 2**32),
    ("seed", 2**32 - 1),
    ("seed", 1.5), ("seed", None),
], ids=lambda v: repr(v))
def test_sampling_values_are_checked(field, bad):
    with pytest.raises(InvalidArgument, match=field):
        SamplingParams(**{field: bad})


def test_sampling_normalises_numbers():
    params = SamplingParams(temperature=1, top_k=np.int32(5), top_p=np.float32(0.5), seed=np.uint32(3))
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (1.0, 5, 0.5, 3)
    assert type(params.temperature) is float and type(params.top_k) is int and not params.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("prompt, reason", [
    (b"hello", "must be text"), (None, "must be"), ("\ud800", "cannot be encoded as UTF-8"), ("", "empty"),
    ([], "empty"), ([1, 2.0], r"prompt\[1\] must be a token id"), ([True], r"prompt\[0\] must be a token id"),
    ([10**6], "outside the vocabulary"), ([-1], "outside the vocabulary"), (np.zeros((2, 2), int), "sequence"),
], ids=repr)
def test_generate_refuses_a_bad_prompt_before_decoding(tiny_model, prompt, reason):
    with Context(tiny_model, n_ctx=256) as ctx:
        with pytest.raises(KvrtError, match=reason):
            generate(ctx, prompt, GenerationParams(max_tokens=2))
        assert ctx.seq_len(0) == 0


def test_generate_takes_numpy_token_ids(tiny_model):
    ids = tiny_model.tokenize("hello there")
    with Context(tiny_model, n_ctx=256) as ctx:
        got = generate(ctx, np.asarray(ids, dtype=np.int32), GenerationParams(max_tokens=2)).tokens
    with Context(tiny_model, n_ctx=256) as ctx:
        assert got == generate(ctx, ids, GenerationParams(max_tokens=2)).tokens


def test_check_helpers_name_the_argument_and_the_value():
    with pytest.raises(InvalidArgument, match=r"n must be an integer, got float 2.5"):
        check_int(2.5, "n")
    with pytest.raises(InvalidArgument, match=r"n 7 is outside \[0, 5\]"):
        check_int(7, "n", low=0, high=5)
    with pytest.raises(InvalidArgument, match=r"x must be in \(0, 1\], got 0"):
        check_real(0, "x", low=0.0, high=1.0, low_open=True)
    with pytest.raises(InvalidArgument, match="x must be a finite number, got nan"):
        check_real(float("nan"), "x", low=0.0, high=1.0)
    with pytest.raises(InvalidArgument, match="x must be a finite number, got int 1000"):
        check_real(10**400, "x")
    with pytest.raises(InvalidArgument, match="surrogates not allowed '\\\\ud800' at character 2"):
        check_text("ab\ud800", "t")
    assert check_tokens(np.arange(3), "ids", 10) == [0, 1, 2]


@pytest.mark.parametrize("kwargs, reason", [
    ({"params": {"n_ctx": 256}}, "ContextParams"), ({"max_idle": -1}, "max_idle"), ({"max_idle": 1.5}, "max_idle"),
], ids=repr)
def test_a_context_pool_checks_its_settings(tiny_model, kwargs, reason):
    from kvrt.engine.context_params import ContextParams
    from kvrt.state.contextpool import ContextPool

    with pytest.raises(InvalidArgument, match=reason):
        ContextPool(tiny_model, **{"params": ContextParams(n_ctx=256), **kwargs})
