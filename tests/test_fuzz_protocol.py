"""Property-based fuzzing of the daemon's line parser: every line is a Command or a ProtocolError.

Random bytes, near-miss lines built from the protocol's own words, and DECODE prompts
sent through escape_prompt; a parsed command must also satisfy the protocol's
documented ranges.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvrt.serve.protocol import (
    MAX_CTX,
    MAX_LINE,
    MAX_TOKENS,
    Command,
    DecodeOptions,
    ProtocolError,
    escape_prompt,
    parse_line,
)

VERBS = ("HELP", "STATUS", "LIST", "QUIT", "REGISTER", "UNREGISTER", "METRICS", "FORK", "DECODE", "CANCEL")
WORDS = st.one_of(
    st.sampled_from(VERBS + tuple(v.lower() for v in VERBS)),
    st.text(max_size=12),
    st.integers(-5, 10**14).map(str),
    st.sampled_from(["\\n", "\\\\", "\\x", "\\", "\t", "\x00", "\r", "\n", " ", "\u2028", "\ufeff", "0" * 13]),
)


def parse_or_refuse(raw: bytes) -> Command | None:
    """The command, or None after checking the refusal is a one-line ERR reply."""
    try:
        command = parse_line(raw)
    except ProtocolError as exc:
        reply = exc.reply()
        assert reply.startswith(f"ERR {exc.code} ") and "\n" not in reply
        return None
    assert isinstance(command, Command) and command.verb in VERBS
    return command


def check_ranges(command: Command) -> None:
    """What the protocol promises about a parsed command's arguments."""
    if command.verb == "REGISTER":
        agent, model, n_ctx, policy, min_ctx, keep = command.args
        assert agent and model and type(n_ctx) is int and 1 <= n_ctx <= MAX_CTX
        assert policy in ("refuse", "shift", "grow")
        assert min_ctx is None or 1 <= min_ctx <= MAX_CTX
        assert keep is None or 0 <= keep <= MAX_CTX
    elif command.verb == "DECODE":
        agent, n_tokens, prompt, options = command.args
        assert agent and type(n_tokens) is int and 1 <= n_tokens <= MAX_TOKENS
        assert isinstance(prompt, str) and prompt and isinstance(options, DecodeOptions)
    else:
        assert all(isinstance(a, str) and a for a in command.args)


@given(st.binary(max_size=400))
@example(b"")
@example(b"\xff\xfe")
@example(b"DECODE a 1 \xed\xa0\x80")  # an encoded lone surrogate is not UTF-8
def test_random_bytes_parse_or_are_refused(raw):
    command = parse_or_refuse(raw)
    if command is not None:
        check_ranges(command)


@given(st.lists(WORDS, max_size=6), st.sampled_from([" ", "  ", "\t"]), st.booleans())
def test_near_miss_lines_parse_or_are_refused(words, sep, newline):
    line = sep.join(words) + ("\n" if newline else "")
    command = parse_or_refuse(line.encode("utf-8", "surrogatepass"))
    if command is not None:
        check_ranges(command)


def test_an_overlong_line_is_refused_without_decoding_it():
    with pytest.raises(ProtocolError) as info:
        parse_line(b"DECODE a 1 " + b"\xff" * MAX_LINE)
    assert info.value.code == "LINE_TOO_LONG"


PROMPTS = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\x00"), min_size=1,
                  max_size=80)


@given(PROMPTS.filter(lambda p: p.strip() and p == p.strip()))
@example("line one\nline two \\ with a backslash")
def test_a_decode_prompt_survives_escaping(prompt):
    command = parse_line(f"DECODE agent 7 {escape_prompt(prompt)}\n".encode())
    assert command.args == ("agent", 7, prompt, DecodeOptions())


def test_a_decode_prompt_keeps_its_trailing_whitespace():
    prompt = "The answer is "
    assert parse_line(f"DECODE agent 7 {escape_prompt(prompt)}\n".encode()).args[2] == prompt
