"""Integer bounds in JSON-schema grammars, checked in llama.cpp's own grammar sampler.

Reference: Python's integers. A grammar from :func:`kvrt.serve.json_grammar.schema_grammar` is
parsed by llama.cpp (``llama_sampler_init_grammar``, the sampler kvrt constrains output with)
and fed a number's text one character token at a time: it is accepted when every character is
allowed and end of generation is allowed after the last one.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from kvrt.bindings import lib
from kvrt.engine.sampling import _Grammar
from kvrt.serve.api_error import ApiError
from kvrt.serve.integer_range import OPEN_DIGITS
from kvrt.serve.json_grammar import integer_bounds, schema_grammar

BOUND = st.one_of(st.none(), st.integers(-2000, 2000), st.integers(-10**20, 10**20))


class Acceptor:
    """Whether llama.cpp's grammar sampler takes a text whole, written in the tiny model's one-character tokens."""

    def __init__(self, model, grammar: str) -> None:
        self.grammar = _Grammar(model, grammar)
        self.eos = 2  # "</s>", the tiny vocabulary's end of generation
        pieces = {t: model.token_to_piece(t) for t in range(model.n_vocab)}
        self.ids = {piece.decode(): t for t, piece in pieces.items() if len(piece) == 1 and piece.isascii()}

    def __call__(self, text: str) -> bool:
        lib().llama_sampler_reset(self.grammar.ptr)
        for char in text:
            token = self.ids[char]
            if not self.grammar.allows(token):
                return False
            lib().llama_sampler_accept(self.grammar.ptr, token)
        return self.grammar.allows(self.eos)


@given(lo=BOUND, hi=BOUND, inside=st.integers())
@example(lo=7, hi=7, inside=0)  # min == max
@example(lo=-13, hi=-13, inside=0)
@example(lo=-205, hi=-13, inside=5)  # all negative
@example(lo=None, hi=-1, inside=0)  # only a maximum, negative
@example(lo=0, hi=None, inside=0)  # only a minimum
@example(lo=-99, hi=100, inside=3)
def test_an_integer_grammar_takes_exactly_the_integers_in_its_bounds(tiny_model, lo, hi, inside):
    assume(lo is not None or hi is not None)  # a bare integer is the converter's own rule
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    schema = {"type": "integer"} | ({} if lo is None else {"minimum": lo}) | ({} if hi is None else {"maximum": hi})
    accepts = Acceptor(tiny_model, schema_grammar(schema, param="response_format"))
    digits = max([OPEN_DIGITS, *(len(str(abs(b))) for b in (lo, hi) if b is not None)])
    least = -(10**digits - 1) if lo is None else lo  # an open side stops at 16 digits, or the other bound's count
    most = 10**digits - 1 if hi is None else hi
    between = least + inside % (most - least + 1)
    for n in {least, least + 1, most - 1, most, between, 0, -1, 1}:
        assert accepts(str(n)) == (least <= n <= most), (n, schema)
    for n in (least - 1, most + 1):
        assert not accepts(str(n)), (n, schema)
    for text in ("-0", "00", "01", "-01", "1.0", "1e3", ""):
        assert not accepts(text), (text, schema)


@pytest.mark.parametrize("schema, bounds", [
    ({"type": "integer", "minimum": 2.5, "maximum": 7.5}, (3, 7)),
    ({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 7}, (3, 6)),
    ({"type": "integer", "exclusiveMinimum": 2.5, "exclusiveMaximum": -0.5}, None),
    ({"type": "integer", "minimum": 2, "exclusiveMinimum": 4}, (5, None)),
    ({"type": "integer", "minimum": 2, "exclusiveMinimum": True, "maximum": 9, "exclusiveMaximum": True}, (3, 8)),
    ({"type": "integer", "minimum": -1, "exclusiveMinimum": False}, (-1, None)),
])
def test_exclusive_and_fractional_bounds_are_the_integers_they_allow(schema, bounds):
    if bounds is None:
        with pytest.raises(ApiError) as refused:
            schema_grammar(schema, param="response_format")
        assert refused.value.param == "response_format" and "no integer fits" in str(refused.value)
    else:
        assert integer_bounds(schema) == bounds


def test_bounds_reach_nested_and_nullable_integers(tiny_model):
    schema = {"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": 10, "maximum": 12}},
              "required": ["n"], "additionalProperties": False}
    accepts = Acceptor(tiny_model, schema_grammar(schema, param="response_format"))
    assert [accepts(f'{{"n":{n}}}') for n in ("9", "10", "12", "13", "null")] == [False, True, True, False, True]


@pytest.mark.parametrize("bad", [{"minimum": "1"}, {"maximum": None}, {"minimum": True}, {"exclusiveMaximum": []}])
def test_bounds_that_are_not_numbers_are_a_400_naming_the_field(bad):
    with pytest.raises(ApiError) as refused:
        schema_grammar({"type": "object", "properties": {"n": {"type": "integer", **bad}}},
                       param="tools[0].function.parameters")
    assert refused.value.status == 400 and refused.value.param == "tools[0].function.parameters"
    assert next(iter(bad)) in str(refused.value)
