"""Tool-call formats, parsing, streaming splits, grammars and the sandboxed Jinja renderer, without a server.

References: the calls written here by hand (parsing), parsing the whole text at once
(streaming splits), llama.cpp's own grammar parser and jsonschema (grammars), jinja2's plain
environment (the sandbox renders what an unsandboxed engine renders).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrt.engine.chat import ChatTemplateError
from kvrt.engine.chat_jinja import render_jinja
from kvrt.serve.api_error import ApiError
from kvrt.serve.tool_calls import CallSplitter, call_grammar, parse_calls, tool_format

NAMES = frozenset({"get_weather", "noargs"})
TEMPLATE = (Path(__file__).parent / "chat_templates" / "hermes_tools.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
    "required": ["city"], "additionalProperties": False}}}


def calls_of(text: str) -> tuple[str, list[tuple[str, dict]]] | None:
    parsed = parse_calls(text, NAMES)
    return None if parsed is None else (parsed[0], [(c.name, json.loads(c.arguments)) for c in parsed[1]])


@pytest.mark.parametrize("text, expected", [
    ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>{"name": "noargs", "arguments": {}}</tool_call>',
     ("Let me look.", [("get_weather", {"city": "Paris"}), ("noargs", {})])),
    ('<tool_call>{"name": "noargs", "arguments": {}}', ("", [("noargs", {})])),  # the closing tag never came
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tokyo"}}, {"name": "noargs", "arguments": "{}"}]',
     ("", [("get_weather", {"city": "Tokyo"}), ("noargs", {})])),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "noargs", "parameters": {}}',
     ("", [("get_weather", {"city": "Paris"}), ("noargs", {})])),
    ('  {"name": "get_weather", "arguments": {"city": "Paris"}}', ("  ", [("get_weather", {"city": "Paris"})])),
    ('[{"type": "function", "function": {"name": "noargs", "arguments": {}}}]', ("", [("noargs", {})])),
])
def test_each_format_parses(text, expected):
    assert calls_of(text) == expected


@pytest.mark.parametrize("text", [
    "plain text, no call",
    'text then {"name": "get_weather", "arguments": {}}',  # a JSON call only counts where it opens the output
    '{"name": "unknown", "arguments": {}}',
    '{"name": "get_weather", "arguments": [1]}',
    '{"name": "get_weather", "arguments": "not json"}',
    '<tool_call>{"name": "noargs", "arguments": {}}</tool_call> and then more words',
    '<tool_call>{"name": "noargs", "arguments": {',
])
def test_text_that_is_not_a_well_formed_call_stays_content(text):
    assert parse_calls(text, NAMES) is None


def test_call_ids_are_distinct_and_arguments_are_compact_json():
    _, calls = parse_calls('[{"name": "noargs", "arguments": {}}, {"name": "noargs", "arguments": {"a": 1}}]', NAMES)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert [c.arguments for c in calls] == ["{}", '{"a":1}']


SAMPLES = ["Hello there <tool_call>", "<tool_call>\n", '{"name": "noargs", "arguments": {}}', "\n</tool_call>", "  ",
           '{"name": "get_weather", "arguments": {"city": "Paris"}}', "<tool", "_call>", "a < b", "[TOOL_", "CALLS]",
           "[", "]", " x"]


@given(st.lists(st.sampled_from(SAMPLES), max_size=6), st.data())
def test_streamed_splits_agree_with_parsing_the_whole_text(pieces, data):
    """However the text arrives, what passes on plus what is left equals the whole text's content, and the calls
    are the whole text's."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    splitter = CallSplitter(NAMES)
    passed = "".join(splitter.feed(chunk) for chunk in chunks)
    rest, calls = splitter.finish()
    whole = parse_calls(text, NAMES)
    if whole is None:
        assert (passed + rest, calls) == (text, [])
    else:
        assert passed + rest == whole[0]
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]]


def test_text_before_a_marker_passes_on_before_the_call_ends():
    splitter = CallSplitter(NAMES)
    assert splitter.feed("Checking") == "Checking"
    assert splitter.feed(" now <tool") == " now "  # "<tool" may begin a marker: held
    assert splitter.feed('_call>{"name": "noargs"') == ""
    assert splitter.feed(', "arguments": {}}</tool_call>') == ""
    rest, calls = splitter.finish()
    assert rest == "" and [c.name for c in calls] == ["noargs"]


@pytest.mark.parametrize("template, fmt", [
    (None, "hermes"), (TEMPLATE, "hermes"), ("{% if tools %}[AVAILABLE_TOOLS]...[TOOL_CALLS]{% endif %}", "mistral"),
    ('<|start_header_id|>{{ "parameters" }}{% if x %}{"name": ..., "parameters": ...}{% endif %}', "llama3"),
    ("{{ messages }}", "json"),
])
def test_format_follows_the_template(template, fmt):
    assert tool_format(template) == fmt


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3", "json"])
@pytest.mark.parametrize("parallel", [False, True])
def test_call_grammars_parse_in_llama_cpp(fmt, parallel):
    from llama_cpp.llama_grammar import LlamaGrammar

    grammar = call_grammar([WEATHER, {"type": "function", "function": {"name": "noargs"}}], fmt, only=None,
                           parallel=parallel)
    LlamaGrammar.from_string(grammar, verbose=False)  # raises on a grammar llama.cpp would refuse
    assert grammar.count("tool-call ::=") == 1


def test_a_named_choice_leaves_only_that_tool_in_the_root():
    grammar = call_grammar([WEATHER, {"type": "function", "function": {"name": "noargs"}}], "json", only="noargs",
                           parallel=False)
    rule = next(line for line in grammar.splitlines() if line.startswith("tool-call ::="))
    assert rule == "tool-call ::= tool-1-call"


def test_a_schema_without_a_grammar_is_refused_naming_its_tool():
    bad = {"type": "function", "function": {"name": "noargs", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "no anchors"}}}}}
    with pytest.raises(ApiError) as refused:
        call_grammar([WEATHER, bad], "hermes", only="get_weather", parallel=False)
    assert refused.value.param == "tools[1].function.parameters" and refused.value.status == 400


def test_the_sandbox_renders_what_plain_jinja_renders():
    import jinja2

    messages = [{"role": "user", "content": "weather <in> Paris & Tokyo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
    expected = env.from_string(TEMPLATE).render(messages=messages, tools=[WEATHER], add_generation_prompt=True)
    assert render_jinja(TEMPLATE, messages, tools=[WEATHER]) == expected
    assert '"enum": ["Paris", "Tokyo"]' in expected  # tojson without HTML escaping


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # reaching Python internals
    "{% set _ = messages.append(1) %}",  # mutating the input
    "{{ raise_exception('no system role') }}",
    "{% for %}",  # does not compile
])
def test_templates_that_misbehave_are_chat_template_errors(source):
    with pytest.raises(ChatTemplateError):
        render_jinja(source, [{"role": "user", "content": "hi"}])
