"""kvrt's OpenAI-compatible server, driven by the official ``openai`` client over real HTTP.

The server runs in-process on 127.0.0.1 (an ephemeral port) with two engines: the demo
model (Gemma 3 270M, with a chat template) and the tiny F32 test model (exact under
batching and prefix reuse, so outputs of different requests can be compared for
equality). Every wait is bounded; nothing asserts on time.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the serve extra (pip install fastapi uvicorn openai) is not installed")
jsonschema = pytest.importorskip("jsonschema")

from kvrt import Context, GenerationParams, generate  # noqa: E402
from kvrt.engine.sampling import SamplingParams  # noqa: E402
from kvrt.runtime.admission import EngineConfig  # noqa: E402
from kvrt.runtime.batching import Engine  # noqa: E402
from kvrt.serve.openai_server import OpenAIServer  # noqa: E402

WAIT_S = 60.0


@pytest.fixture(scope="module")
def served(demo_model, tiny_model) -> Iterator[dict[str, Any]]:
    engines = {
        demo_model.path.stem: Engine(demo_model, EngineConfig(n_ctx=2048, n_seq_max=4, n_batch=256)),
        tiny_model.path.stem: Engine(tiny_model, EngineConfig(n_ctx=1024, n_seq_max=4, n_batch=64,
                                                              flash_attn="off")),
    }
    server = OpenAIServer(engines, default_max_tokens=32)
    host, port = server.start("127.0.0.1", 0)
    try:
        yield {"server": server, "url": f"http://{host}:{port}", "demo": demo_model.path.stem,
               "tiny": tiny_model.path.stem, "engines": engines}
    finally:
        server.stop()
        for engine in engines.values():
            engine.close()


@pytest.fixture(scope="module")
def client(served) -> Any:
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def http_json(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def reference(model, tokens: list[int], max_tokens: int, **sampling: Any):
    """kvrt's one-sequence generate() in a fresh context: what a request alone must produce."""
    with Context(model, n_ctx=1024, flash_attn="off") as ctx:
        return generate(ctx, tokens, GenerationParams(max_tokens=max_tokens,
                                                      sampling=SamplingParams(**sampling)))


def test_the_front_says_which_event_loop_and_http_parser_it_runs_on(served):
    """The serve extra installs uvloop and httptools, and uvicorn takes them: the pure-Python fallbacks (asyncio's
    loop and h11) would cost every streamed token more of the interpreter the engine's thread shares."""
    import importlib.util

    expected = ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio") + " + " + (
        "httptools" if importlib.util.find_spec("httptools") else "h11")
    assert served["server"].runs_on == expected
    unstarted = OpenAIServer(served["engines"])
    try:
        assert unstarted.runs_on == ""
    finally:
        unstarted.stop()


def test_models_are_listed_by_file_stem(client, served):
    assert {m.id for m in client.models.list().data} == {served["demo"], served["tiny"]}
    assert client.models.retrieve(served["tiny"]).id == served["tiny"]


def test_streaming_chat_completion_on_the_demo_model(client, served, demo_model):
    messages = [{"role": "user", "content": "Name three colours."}]
    chunks = list(client.chat.completions.create(
        model=served["demo"], messages=messages, max_tokens=16, temperature=0, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert content.strip()
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == content  # every token's text, in order
    for entry in entries:  # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    usage = chunks[-1].usage
    from kvrt.engine.chat import apply_chat_template

    prompt = demo_model.tokenize(apply_chat_template(demo_model, messages), parse_special=True)
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(entries)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_json_schema_output_parses_and_validates(client, served):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    response = client.chat.completions.create(
        model=served["demo"], messages=[{"role": "user", "content": "Invent a person; answer in JSON."}],
        max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)



def test_json_object_uses_the_generic_object_grammar(client, served):
    """The demo model rambles inside an open object past any small max_tokens, so only the grammar
    (a JSON object of anything) and the output's start are checked."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from kvrt.serve.openai_schema import ResponseFormat, grammar_of

    assert grammar_of(ResponseFormat(type="json_object")) == json_schema_to_gbnf('{"type": "object"}')
    response = client.chat.completions.create(
        model=served["demo"], messages=[{"role": "user", "content": "Describe a cat as JSON."}], max_tokens=6,
        temperature=0, response_format={"type": "json_object"})
    assert response.choices[0].message.content.startswith("{")


def test_n_choices_on_the_demo_model(client, served):
    response = client.chat.completions.create(
        model=served["demo"], messages=[{"role": "user", "content": "Say something."}], max_tokens=8, n=2,
        temperature=1.0, seed=11)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens >= 2


def test_n_choices_fork_with_consecutive_seeds(client, served, tiny_model):
    prompt = "Hello world, this is"
    response = client.completions.create(model=served["tiny"], prompt=prompt, max_tokens=12, n=2,
                                         temperature=1.0, seed=5)
    tokens = tiny_model.tokenize(prompt, parse_special=True)
    for i, choice in enumerate(response.choices):  # choice i samples with seed + i, from one prefill
        assert choice.text == reference(tiny_model, tokens, 12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                        seed=5 + i).text
    assert response.usage.completion_tokens == 24


def test_completion_logprobs(client, served):
    response = client.completions.create(model=served["demo"], prompt="The capital of France is", max_tokens=6,
                                         temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(value) and top.get(chosen) == pytest.approx(value)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == response.choices[0].text



def test_return_tokens_gives_the_choice_token_ids_whole_and_streamed(client, served, tiny_model):
    prompt = tiny_model.tokenize("Token ids in, token ids out", parse_special=True)
    base = dict(model=served["tiny"], prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_tokens": True,
                                                                                                "ignore_eos": True})
    whole = client.completions.create(**base).choices[0]
    streamed = [t for c in client.completions.create(**base, stream=True) if c.choices
                for t in c.choices[0].model_extra["tokens"]]
    expected = reference(tiny_model, prompt, 8, temperature=0.0).tokens
    assert whole.model_extra["tokens"] == streamed == expected and len(expected) == 8

def test_stop_strings_cut_the_text(client, served):
    base = dict(model=served["tiny"], prompt="Another prompt that is longer", max_tokens=24, temperature=0)
    full = client.completions.create(**base).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = client.completions.create(**base, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, stop=stop, stream=True)
                       if c.choices)
    assert streamed == cut.text


def test_seed_reproducibility(client, served):
    base = dict(model=served["tiny"], prompt="x", max_tokens=24, temperature=1.0, top_p=0.9)
    first = client.completions.create(**base, seed=42).choices[0].text
    again = client.completions.create(**base, seed=42).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, seed=42, stream=True)
                       if c.choices)
    other = client.completions.create(**base, seed=43).choices[0].text
    assert first == again == streamed
    assert other != first


def test_prefix_reuse_over_http(client, served, tiny_model):
    shared = "A shared system prompt that several requests start with. " * 2
    client.completions.create(model=served["tiny"], prompt=shared + "First?", max_tokens=4, temperature=0)
    second = client.completions.create(model=served["tiny"], prompt=shared + "Second!", max_tokens=4,
                                       temperature=0)
    tokens = tiny_model.tokenize(shared + "Second!", parse_special=True)
    n_shared = len(tiny_model.tokenize(shared))
    assert second.usage.prompt_tokens == len(tokens)
    assert second.usage.prompt_tokens_details.cached_tokens >= n_shared - 1
    assert second.choices[0].text == reference(tiny_model, tokens, 4, temperature=0.0).text


def test_pin_and_fork(served, client, tiny_model):
    url, name = served["url"], served["tiny"]
    document = "a pinned document " * 5
    status, pin = http_json("POST", url + "/v1/kvrt/pins", {"model": name, "prompt": document})
    assert status == 200 and pin["tokens"] == len(tiny_model.tokenize(document))
    status, stats = http_json("GET", url + "/v1/kvrt/stats")
    assert "pinned" in stats[name]["slots"]
    prompt = tiny_model.tokenize(document) + tiny_model.tokenize("first", add_special=False)
    first = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)  # token ids
    assert first.usage.prompt_tokens_details.cached_tokens == pin["tokens"]
    status, fork = http_json("POST", url + "/v1/kvrt/fork", {"model": name, "completion_id": first.id,
                                                             "prompt": " and then", "max_tokens": 6,
                                                             "temperature": 0})
    assert status == 200, fork
    generated = reference(tiny_model, prompt, 6, temperature=0.0).tokens
    suffix = tiny_model.tokenize(" and then", add_special=False, parse_special=True)
    continued = prompt + generated + suffix  # the earlier completion's exact tokens, then the new text
    assert fork["usage"]["prompt_tokens"] == len(continued)
    assert fork["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + len(generated) - 1
    assert fork["choices"][0]["text"] == reference(tiny_model, continued, 6, temperature=0.0).text
    status, gone = http_json("DELETE", url + f"/v1/kvrt/pins/{pin['id']}")
    assert status == 200 and gone["deleted"] is True
    assert http_json("DELETE", url + f"/v1/kvrt/pins/{pin['id']}")[0] == 404
    assert http_json("POST", url + "/v1/kvrt/fork", {"model": name, "completion_id": "cmpl-nope"})[0] == 404


def test_errors_are_openai_shaped(client, served):
    tiny, demo = served["tiny"], served["demo"]
    chat = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(model=demo, messages=chat, temperature=5), "temperature"),
        (dict(model=demo, messages=chat, n=0), "n"),
        (dict(model=demo, messages=chat, max_tokens=10**6), "max_tokens"),
        (dict(model=demo, messages=chat, response_format={"type": "xml"}), "response_format.type"),
        (dict(model=demo, messages=chat, top_logprobs=2), "top_logprobs"),
        (dict(model=tiny, messages=chat), "messages"),  # the tiny model has no chat template
        (dict(model=demo, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**kwargs)
        assert caught.value.status_code == 400 and caught.value.body["param"] == param, (kwargs, caught.value.body)
        assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=tiny, prompt=["one", "two"])
    assert caught.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=chat)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    status, body = http_json("POST", served["url"] + "/v1/completions", b"{not json")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = http_json("POST", served["url"] + "/v1/chat/completions", {"model": demo, "messages": chat,
                                                                            "tools": [{"type": "function"}]})
    assert status == 400 and body["error"]["param"] == "tools[0].function"  # a tool without its function


def test_client_disconnect_cancels_the_request(served):
    engine = served["engines"][served["tiny"]]
    host, port = served["url"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    body = json.dumps({"model": served["tiny"], "prompt": "x", "max_tokens": 900, "stream": True})
    connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.close()
    limit = time.monotonic() + WAIT_S
    while engine.stats().active and time.monotonic() < limit:  # a bounded wait, not a timing assertion
        time.sleep(0.05)
    assert engine.stats().active == 0
    assert engine.stats().decoded_tokens < 10**6


def test_overloaded_engine_answers_503(tiny_model):
    release = threading.Event()
    engine = Engine(tiny_model, EngineConfig(n_ctx=256, n_seq_max=1, n_batch=32, max_queue=1),
                    before_step=release.wait)
    server = OpenAIServer({"tiny": engine})
    host, port = server.start()
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    results: list[Any] = []
    waiting = threading.Thread(target=lambda: results.append(
        client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0)))
    try:
        waiting.start()
        limit = time.monotonic() + WAIT_S
        while engine.stats().queued < 1 and time.monotonic() < limit:  # the engine is held: it stays queued
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="tiny", prompt="y", max_tokens=4)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "overloaded"
    finally:
        release.set()
        waiting.join(WAIT_S)
        server.stop()
        engine.close()
    assert results and results[0].choices[0].finish_reason == "length"


def test_a_completion_prompt_is_one_text_or_one_id_list_wrapped_or_not(served):
    """Token ids are checked on the event loop and text tokenized off it (``single_prompt`` tells them apart): a
    list of one id list answers as the ids do, more than one prompt and an empty one are refused by name."""
    url, name = served["url"] + "/v1/completions", served["tiny"]
    ids = [5, 6, 7, 8]
    body = {"model": name, "max_tokens": 4, "temperature": 0}
    status, plain = http_json("POST", url, body | {"prompt": ids})
    assert status == 200
    status, wrapped = http_json("POST", url, body | {"prompt": [ids]})
    assert status == 200 and wrapped["choices"][0]["text"] == plain["choices"][0]["text"]
    status, error = http_json("POST", url, body | {"prompt": [ids, ids]})
    assert status == 400 and "one prompt per request, got 2" in error["error"]["message"]
    status, error = http_json("POST", url, body | {"prompt": []})
    assert status == 400 and "it is empty" in error["error"]["message"]
