"""Tool calling through kvrt's OpenAI server, driven by the official ``openai`` client over real HTTP.

The model is the tiny test model with a Jinja chat template that teaches tools
(``tests/chat_templates/hermes_tools.jinja``): its random weights write noise, so a call
comes only where the grammar forces one, and what is checked is structure: arguments
that parse and validate against the tool's schema (jsonschema), the prompt the template
renders (compared with jinja2 rendering it outside the server), streamed deltas that
add up to the unstreamed answer, and bad input refused with the field named.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the serve extra (pip install fastapi uvicorn openai) is not installed")
jsonschema = pytest.importorskip("jsonschema")
jinja2 = pytest.importorskip("jinja2")

from kvrt.runtime.admission import EngineConfig  # noqa: E402
from kvrt.runtime.batching import Engine  # noqa: E402
from kvrt.serve.openai_server import OpenAIServer  # noqa: E402

WAIT_S = 60.0
TEMPLATE = (Path(__file__).parent / "chat_templates" / "hermes_tools.jinja").read_text()
WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                                 "days": {"type": "integer"}, "metric": {"type": "boolean"}},
                "required": ["city", "days"], "additionalProperties": False}
TIME_ARGS = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
             "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGS}}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tools_server) -> Any:
    return openai.OpenAI(base_url=tools_server["url"] + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def chat(client, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="tiny-tools", **{"messages": ASK, "max_tokens": 160, **kwargs})


def rendered_tokens(model, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt as jinja2 renders the template outside the server (arguments as objects, as templates expect)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    turns = []
    for m in messages:
        turn = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            turn["tool_calls"] = [{**c, "function": {**c["function"],
                                                     "arguments": json.loads(c["function"]["arguments"])}}
                                  for c in m["tool_calls"]]
        turns.append(turn)
    text = env.from_string(TEMPLATE).render(messages=turns, tools=tools, add_generation_prompt=True)
    return model.tokenize(text, parse_special=True)


def assert_valid(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forced_calls_fit_their_schemas(client, choice, names, seed):
    response = chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, parallel_tool_calls=False)
    choice0 = response.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    assert len(choice0.message.tool_calls) == 1
    assert_valid(choice0.message.tool_calls, names)


BOUNDED_ARGS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 2, "maximum": 5},
                                                 "offset": {"type": "integer", "exclusiveMinimum": -40,
                                                            "exclusiveMaximum": -30},
                                                 "count": {"type": "integer", "minimum": 1000}},
                "required": ["days", "offset", "count"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_forced_integer_arguments_stay_within_their_bounds(client, seed):
    """The tiny model writes random digits: only the grammar keeps each integer in its schema's range."""
    tools = [{"type": "function", "function": {"name": "plan", "parameters": BOUNDED_ARGS}}]
    response = chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "plan"}},
                    temperature=1.0, seed=seed, parallel_tool_calls=False)
    (call,) = response.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), BOUNDED_ARGS)


def test_a_forced_choice_replaces_response_format(client):
    """As with OpenAI: the output of a forced choice is calls; a text format governs text only."""
    response = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0,
                    response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "tool_calls"
    assert_valid(response.choices[0].message.tool_calls, {"get_weather", "get_time"})


def test_parallel_calls_are_each_parsed(client):
    """Allowed parallel calls, the sampled output holds one or more, each a call fitting its schema."""
    for seed in range(4):
        response = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=400)
        assert response.choices[0].finish_reason == "tool_calls"
        assert_valid(response.choices[0].message.tool_calls, {"get_weather", "get_time"})
        calls = response.choices[0].message.tool_calls
        assert len({c.id for c in calls}) == len(calls)


def test_streamed_call_deltas_add_up_to_the_unstreamed_answer(client):
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=0, parallel_tool_calls=False)
    whole = chat(client, **kwargs).choices[0].message.tool_calls
    chunks = list(chat(client, stream=True, **kwargs))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    opening, *rest = deltas
    assert (opening.index, opening.type, opening.function.name, opening.function.arguments) == \
        (0, "function", whole[0].function.name, "")
    assert opening.id.startswith("call_") and all(d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == whole[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_tool_loop_history_is_rendered_by_the_models_template(client, tools_server):
    """Assistant calls with null content and the tool's answer go through the GGUF's Jinja template: the
    prompt is the tokens jinja2 renders for the same history."""
    first = chat(client, tools=TOOLS, tool_choice="required", temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = chat(client, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
    assert answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens == len(rendered_tokens(tools_server["model"], history, None))
    auto = chat(client, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert auto.usage.prompt_tokens == len(rendered_tokens(tools_server["model"], history, TOOLS))


def test_auto_passes_text_that_holds_no_call_through(client, tools_server):
    """Unforced, the noise the tiny model writes is content, exactly what the same prompt completes to."""
    response = chat(client, tools=TOOLS, temperature=0, max_tokens=24)
    prompt = rendered_tokens(tools_server["model"], ASK, TOOLS)
    reference = client.completions.create(model="tiny-tools", prompt=prompt, max_tokens=24, temperature=0)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content == reference.choices[0].text
    assert response.usage.prompt_tokens == len(prompt)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "unanchored"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://example.com/s"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}
HISTORY: list[tuple[list[dict[str, Any]], str]] = [
    ([{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": CALL["function"]}]}],
     "messages[1].tool_calls[0].id"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}],
     "messages[1].tool_calls[0].function"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls[0].function.name"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"}],
     "messages[2].tool_call_id"),
    ([{"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "x",
                                                                       "tool_call_id": "call_2"}],
     "messages[2].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[1].tool_calls"),
    ([{"role": "assistant", "content": None}], "messages[1].content"),
]


@pytest.mark.parametrize("extra, param", BAD + [({"messages": ASK + h}, p) for h, p in HISTORY])
def test_bad_tool_input_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **extra)
    assert refused.value.status_code == 400 and refused.value.body["param"] == param, refused.value.body
    assert refused.value.body["message"].startswith(param) or param in refused.value.body["message"]
    after = chat(client, tools=TOOLS, tool_choice="required", temperature=0, parallel_tool_calls=False)
    assert after.choices[0].finish_reason == "tool_calls"  # nothing else disturbed


def test_a_waiting_stream_gets_keep_alives(tools_server):
    """One slot, busy with a long request: the second stream waits in the queue and is sent keep-alive comments
    before any output, then its answer as usual."""
    engine = Engine(tools_server["model"], EngineConfig(n_ctx=2048, n_seq_max=1, n_batch=64, flash_attn="off"))
    server = OpenAIServer({"m": engine}, sse_keepalive_s=0.01)
    host, port = server.start("127.0.0.1", 0)
    try:
        busy = http.client.HTTPConnection(host, port, timeout=WAIT_S)
        busy.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 1900,
                                                            "ignore_eos": True, "stream": True}))
        busy_response = busy.getresponse()
        while not busy_response.readline().startswith(b"data: "):  # until it is running
            pass
        waiting = http.client.HTTPConnection(host, port, timeout=WAIT_S)
        waiting.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": ASK, "stream": True,
                                                                    "max_tokens": 4}))
        response = waiting.getresponse()
        assert response.status == 200
        before = []
        while (line := response.readline()) != b": keep-alive\n":
            before.append(line)
        opened = [json.loads(line[6:]) for line in before if line.startswith(b"data: ")]
        assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in opened)  # no output yet
        busy.close()  # the client goes away: its request is cancelled and the slot freed
        events = [e for e in response.read().decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"]
    finally:
        server.stop()
        engine.close()


def test_a_model_without_a_jinja_template_gets_the_hermes_fallback(demo_model):
    """The demo model's GGUF has no Jinja template: tools are described in a system turn, and calls and results
    are written as Hermes text into turns llama.cpp's built-in template renders."""
    from kvrt.engine.chat import apply_chat_template

    engine = Engine(demo_model, EngineConfig(n_ctx=2048, n_seq_max=2, n_batch=256))
    server = OpenAIServer({"demo": engine})
    host, port = server.start("127.0.0.1", 0)
    try:
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
        forced = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, temperature=0, max_tokens=160)
        assert forced.choices[0].finish_reason == "tool_calls"
        assert_valid(forced.choices[0].message.tool_calls, {"get_weather", "get_time"})
        call = forced.choices[0].message.tool_calls[0]
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        answer = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                                max_tokens=4)
        written = json.dumps({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
        plain = [ASK[0], {"role": "assistant", "content": f"<tool_call>\n{written}\n</tool_call>"},
                 {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}]
        expected = demo_model.tokenize(apply_chat_template(demo_model, plain), parse_special=True)
        assert answer.usage.prompt_tokens == len(expected)
    finally:
        server.stop()
        engine.close()
