"""OpenAI's Responses API on kvrt (``/v1/responses``), driven by the official ``openai`` client over real HTTP.

References: the same request through chat completions (a response is that answer, reshaped),
a chain's prompt written by hand (the earlier turn's exact tokens, then the ChatML text of what
is new) and completed by a fresh server, llama.cpp's template for a conversation a chain renders
again, and jsonschema (forced calls and JSON output fit their schemas). The model is the tiny test
model with a tools template: its text is noise, so structure is what is checked.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the serve extra (pip install fastapi uvicorn openai) is not installed")
jsonschema = pytest.importorskip("jsonschema")

from kvrt.engine.chat import apply_chat_template  # noqa: E402
from kvrt.runtime.admission import EngineConfig  # noqa: E402
from kvrt.runtime.batching import Engine  # noqa: E402
from kvrt.serve.openai_server import OpenAIServer  # noqa: E402
from test_tools_http import ASK, WAIT_S, WEATHER_ARGS  # noqa: E402  (tests/ is on sys.path)

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather", "parameters": WEATHER_ARGS}]


@pytest.fixture(scope="module")
def client(tools_server: dict[str, Any]) -> Any:
    return openai.OpenAI(base_url=tools_server["url"] + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def respond(client, **kwargs: Any) -> Any:
    return client.responses.create(model="tiny-tools", **{"temperature": 0, "max_output_tokens": 12, **kwargs})


def test_a_text_response_is_the_chat_answer_reshaped(client):
    response = respond(client, input=ASK[0]["content"], instructions="Be brief.")
    chat = client.chat.completions.create(model="tiny-tools", temperature=0, max_tokens=12,
                                          messages=[{"role": "system", "content": "Be brief."}, *ASK])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_a_chain_continues_from_the_tool_calls_exact_tokens(client, tools_server):
    """The forced call, as the model wrote it, stays in the conversation: the next request prefills only the
    template's end of turn, the tool's answer (the template's text for a tool message, written here by hand) and
    the generation prompt."""
    first = respond(client, input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=160)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_ARGS)
    second = respond(client, previous_response_id=first.id, tools=TOOLS,
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    new = ("<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
           "<|im_start|>assistant\n")
    earlier = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens == earlier  # not prefilled again
    assert second.usage.input_tokens == earlier + len(tools_server["model"].tokenize(new, add_special=False,
                                                                                     parse_special=True))
    assert second.previous_response_id == first.id


FORECAST = {"type": "string", "enum": ["Paris: sunny, 21 C"]}  # the grammar writes this, in tokens of its choosing


@pytest.fixture(scope="module")
def reference(tools_server: dict[str, Any]) -> Any:
    """A second server on the same model, fresh: completions of given token ids (``return_tokens``), unchained."""
    engine = Engine(tools_server["model"], EngineConfig(n_ctx=2048, n_seq_max=4, n_batch=128, flash_attn="off"))
    server = OpenAIServer({"tiny-tools": engine})
    host, port = server.start("127.0.0.1", 0)
    try:
        yield openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    finally:
        server.stop()
        engine.close()


@pytest.mark.parametrize("streamed", [False, True])
def test_a_chain_continues_from_the_exact_tokens_of_each_turn(client, tools_server, reference, streamed):
    """Each answer is written in tokens that its text does not tokenize back to, so a chain that rendered the
    answer again would prefill it (and all after it) again. Reference: the prompt written by hand (the earlier
    prompt's and answer's exact ids, then the ChatML end of turn and the new user turn as text), completed
    by a fresh server; the chain's answer is that completion, and only the new tokens were prefilled."""
    model = tools_server["model"]
    previous, exact = None, []
    for ask in ["Forecast for Paris, exactly?", "And for tomorrow?", "And after that?"]:
        ask += " (streamed)" if streamed else ""  # no prompt of the other run is cached
        kwargs: dict[str, Any] = {"input": ask, "max_output_tokens": 64,
                                  "text": {"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST}}}
        if previous is not None:
            kwargs["previous_response_id"] = previous.id
        if streamed:
            with client.responses.stream(model="tiny-tools", temperature=0, **kwargs) as stream:
                response = stream.get_final_response()
        else:
            response = respond(client, **kwargs)
        new = ("<|im_end|>\n" if exact else "") + f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n"
        prompt = exact + model.tokenize(new, add_special=not exact, parse_special=True)
        expected = reference.completions.create(
            model="tiny-tools", prompt=prompt, temperature=0, max_tokens=64,
            extra_body={"return_tokens": True, "response_format": {
                "type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}}).choices[0]
        tokens = expected.model_extra["tokens"]
        assert expected.finish_reason == "stop" and json.loads(expected.text) == FORECAST["enum"][0]
        assert model.tokenize(expected.text, add_special=False, parse_special=True) != tokens  # no round trip
        assert response.output_text == expected.text
        assert response.usage.input_tokens == len(prompt)
        if exact:  # every earlier token was reused: only the new ones were prefilled
            assert response.usage.input_tokens_details.cached_tokens == len(exact)
        previous, exact = response, prompt + tokens


def test_an_answer_cut_by_a_stop_string_is_rendered_again(client, tools_server, reference):
    """Its tokens hold text its answer does not (the stop string): the chain renders the conversation it says,
    which a fresh server completes to the same answer."""
    full = respond(client, input="Say something.")
    first = respond(client, input="Say something.", extra_body={"stop": [full.output_text[6:8]]})
    assert first.output_text != full.output_text
    second = respond(client, previous_response_id=first.id, input="And then?")
    history = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    model = tools_server["model"]
    prompt = model.tokenize(apply_chat_template(model, history), parse_special=True)
    expected = reference.completions.create(model="tiny-tools", prompt=prompt, temperature=0, max_tokens=12)
    assert (second.usage.input_tokens, second.output_text) == (len(prompt), expected.choices[0].text)


def test_instructions_belong_to_their_own_request(client, tools_server, caplog):
    """Without the earlier instructions the earlier conversation as rendered does not begin this one: it is
    rendered whole again, and a debug line says so."""
    first = respond(client, input=ASK, instructions="Answer in French.")
    with caplog.at_level(logging.DEBUG, logger="kvrt.serve.http"):
        second = respond(client, previous_response_id=first.id, input="And tomorrow?")
    assert "does not begin this one" in caplog.text
    history = [*ASK, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And tomorrow?"}]
    model = tools_server["model"]  # no tools in sight: llama.cpp's built-in template renders it
    assert second.usage.input_tokens == len(model.tokenize(apply_chat_template(model, history), parse_special=True))


VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}


@pytest.mark.parametrize("forced", [False, True])
def test_a_streamed_response_is_the_unstreamed_one_in_events(client, forced):
    """The SDK's stream helper accumulates the events (and refuses any out of order); the response it ends with
    has the unstreamed response's output, and each item's deltas add up to it. Both outputs are constrained, so
    the noise of the tiny model ends (the helper takes only completed responses)."""
    kwargs: dict[str, Any] = dict(input=ASK, max_output_tokens=160)
    if forced:
        kwargs |= dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    else:
        kwargs |= dict(text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}})
    whole = respond(client, **kwargs)
    with client.responses.stream(model="tiny-tools", temperature=0, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [(i.type, i.status) for i in final.output] == [(i.type, i.status) for i in whole.output]
    if forced:
        assert (final.output[0].name, final.output[0].arguments) == (whole.output[0].name, whole.output[0].arguments)
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    else:
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert final.output_text == whole.output_text
    assert deltas == (final.output[0].arguments if forced else final.output_text)
    stored = client.responses.retrieve(final.id)  # stored as streamed: the same items
    assert final.id == events[0].response.id and [i.id for i in stored.output] == [i.id for i in final.output]


def test_json_output_through_text_format(client):
    response = respond(client, input=ASK, max_output_tokens=40,
                       text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}})
    jsonschema.validate(json.loads(response.output_text), VERDICT)


def test_stored_responses_are_retrieved_deleted_and_unstored_ones_are_not_kept(client):
    kept = respond(client, input="hello")
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    client.responses.delete(kept.id)
    unkept = respond(client, input="hello", store=False)
    for gone in (kept.id, unkept.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError) as missing:
            respond(client, input="more", previous_response_id=gone)
        assert missing.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("extra, param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "function_call", "name": "get_weather", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.function.name"),
])
def test_bad_input_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        respond(client, **extra)
    assert refused.value.body["param"] == param, refused.value.body
