"""Exact prefix reuse (``Request(exact=True)``, the HTTP body's ``exact_prefix``, ``kvrt serve --exact-prefix``)
against a cold run of the same prompt.

llama.cpp's CPU kernels round differently by micro-batch shape: on the demo model (Q4_K_M)
the same prompt gives other logits when its cached prefix ends mid prefill unit and the
rest is computed in another shape (measured on this repository's Xeon VM: first-token
logits off by 0.6-1.3, greedy outputs different in 10 of 27 prompt/prefix pairs with
flash attention off, 13 of 18 with it on; ``bench/RESULTS.md``). An exact request reuses
only whole units computed cold and prefills the rest alone, so it must equal a cold engine
bit for bit: its first token's 20 log-probabilities (a float64 log-softmax over every
logit: any changed logit moves them) and its greedy tokens. The tiny F32 model is exact
either way; it checks the bookkeeping (which positions count as cold, and through which
copies that count travels).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrt.engine.generation import GenerationParams
from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import Request, RequestResult, TokenEvent, token_logprobs

PROMPT_TOKENS = 450  # within a default slot's 512 cells, past the demo model's 256-token prefill unit
MAX_TOKENS = 8
TOP = 20
CONFIG = EngineConfig(n_ctx=4096, n_seq_max=8, n_batch=512, prefill_chunk=256, n_threads=2, flash_attn="off")
UNIT = CONFIG.prefill_unit


def run(engine: Engine, prompt: list[int], *, exact: bool = False, max_tokens: int = MAX_TOKENS) -> RequestResult:
    """One greedy request with the top-20 log-probabilities of every token."""
    request = Request(prompt, GenerationParams(max_tokens=max_tokens), logprobs=TOP, exact=exact)
    return engine.submit(request).result(timeout=300)


def outcome(result: RequestResult) -> tuple[list[int], object]:
    """What must be bit-identical: the greedy tokens and the first token's log-probabilities."""
    choice = result.choices[0]
    return choice.tokens, choice.logprobs[0]


@pytest.fixture(scope="module")
def prompt(demo_model) -> list[int]:
    from kvrt.modelfiles.demo_model import license_terms_text

    text = license_terms_text()
    tokens = demo_model.tokenize(text[text.find("Gemma Terms of Use"):])[:PROMPT_TOKENS]
    assert len(tokens) == PROMPT_TOKENS
    return tokens


@pytest.fixture(scope="module", params=["off", "on"])
def flash_attn(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cold(demo_model, prompt, flash_attn) -> RequestResult:
    """The prompt in an engine that never saw it."""
    with Engine(demo_model, CONFIG, flash_attn=flash_attn) as engine:
        result = run(engine, prompt)
    assert result.end.cached_tokens == 0 and len(result.choices[0].tokens) == MAX_TOKENS
    return result


@pytest.mark.slow
@pytest.mark.parametrize("cached", [PROMPT_TOKENS - 3, 300])
def test_an_exact_request_equals_a_cold_engine_where_the_cached_prefix_ends_mid_unit(demo_model, prompt, cold,
                                                                                    flash_attn, cached):
    """Without the flag the whole cached prefix is reused, as before; with it only the unit before it, and the
    output is the cold engine's."""
    with Engine(demo_model, CONFIG, flash_attn=flash_attn) as engine:
        run(engine, prompt[:cached], max_tokens=1)
        plain = run(engine, prompt)
        exact = run(engine, prompt, exact=True)
    assert plain.end.cached_tokens == cached
    assert exact.end.cached_tokens == cached // UNIT * UNIT == UNIT
    assert outcome(exact) == outcome(cold)


@pytest.mark.slow
def test_an_exact_request_prefilled_beside_a_decoding_one_equals_a_cold_engine(demo_model, prompt, cold, flash_attn):
    """Its prefill steps hold nothing else (a step shared with another sequence's token changes the shapes: measured
    here, first-token logits off by 0.86 with nothing cached)."""
    with Engine(demo_model, CONFIG, flash_attn=flash_attn) as engine:
        run(engine, prompt[:PROMPT_TOKENS - 3], max_tokens=1)
        other = engine.submit(Request(demo_model.tokenize("Write a long story about a lighthouse."),
                                      GenerationParams(max_tokens=400, ignore_eos=True)))
        assert isinstance(other.get(timeout=300), TokenEvent)  # it decodes while the exact request prefills
        try:
            exact = run(engine, prompt, exact=True)
        finally:
            other.cancel()
        assert other.result(timeout=300).choices[0].finish_reason == "cancelled"
    assert outcome(exact) == outcome(cold)


@pytest.mark.slow
def test_a_cold_engine_equals_llama_cpp_python_from_scratch(demo_model_path: Path, prompt, cold, flash_attn):
    """The reference evaluates the prompt in the engine's prefill steps (``n_batch`` = the prefill unit)."""
    import llama_cpp
    import numpy as np

    from kvrt.system.cpu import llama_cpp_llama
    from kvrt_bench._peer import greedy_reference

    llm = llama_cpp_llama(demo_model_path, n_ctx=1024, n_batch=UNIT, n_ubatch=UNIT, n_threads=2, n_threads_batch=2,
                          flash_attn=flash_attn == "on", verbose=False)
    try:
        llm.eval(prompt)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
        tokens = greedy_reference(llm, [], prompt, MAX_TOKENS).tokens
    finally:
        llm.close()
    assert (tokens, token_logprobs(logits, int(logits.argmax()), TOP)) == outcome(cold)


# -- the bookkeeping, on the tiny model ------------------------------------------------------------------------
TINY = EngineConfig(n_ctx=1024, n_seq_max=2, n_batch=64, prefill_chunk=16, flash_attn="off")


@pytest.fixture
def tiny_engine(tiny_model) -> Iterator[Engine]:
    with Engine(tiny_model, TINY) as engine:
        yield engine


def tiny_prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 131 + 7 * i) % 500 + 1 for i in range(n)]


@pytest.mark.parametrize(("prefill_chunk", "n_batch", "unit"), [(256, 512, 256), (512, 512, 512), (16, 64, 16),
                                                                 (1024, 2048, 512), (768, 2048, 768),
                                                                 (600, 512, 512)])
def test_the_prefill_unit_is_where_a_cold_prefills_micro_batches_repeat(prefill_chunk, n_batch, unit):
    assert EngineConfig(n_seq_max=1, prefill_chunk=prefill_chunk, n_batch=n_batch).prefill_unit == unit


def test_whole_units_prefilled_alone_count_as_cold(tiny_engine):
    prompt = tiny_prompt(1)
    run(tiny_engine, prompt, max_tokens=4)
    slot, held = tiny_engine.cache.longest_prefix(prompt)
    assert slot is not None and held == len(prompt)
    assert tiny_engine.cache.cold_prefix(slot, 1000) == 32  # [0, 16), [16, 32) alone; [32, 40) is a part unit
    follow_up = prompt[:37] + tiny_prompt(2, 10)
    assert run(tiny_engine, follow_up, exact=True).end.cached_tokens == 32
    assert run(tiny_engine, follow_up).end.cached_tokens == len(follow_up) - 1


def test_a_prefill_that_shared_its_steps_is_not_cold(tiny_engine):
    """Chunks decoded beside another request's tokens are not in a cold prefill's shape: nothing of them is reused
    exactly, until an exact request has prefilled them alone."""
    other = tiny_engine.submit(Request(tiny_prompt(3), GenerationParams(max_tokens=470, ignore_eos=True)))
    assert isinstance(other.get(timeout=60), TokenEvent)
    try:
        prompt = tiny_prompt(4)
        shared = run(tiny_engine, prompt, max_tokens=2)
        first = run(tiny_engine, prompt, exact=True)
        again = run(tiny_engine, prompt, exact=True)
    finally:
        other.cancel()
    assert other.result(timeout=60).choices[0].finish_reason == "cancelled"  # it decoded beside them throughout
    assert (shared.end.cached_tokens, first.end.cached_tokens, again.end.cached_tokens) == (0, 0, 32)


def test_a_host_copy_keeps_its_cold_count(tiny_model):
    with Engine(tiny_model, TINY, host_bytes=8 << 20) as engine:
        prompt = tiny_prompt(5)
        run(engine, prompt, max_tokens=4)
        run(engine, tiny_prompt(6), max_tokens=4)
        run(engine, tiny_prompt(7), max_tokens=4)  # two slots: the first prompt's is evicted to the host tier
        assert engine.cache.longest_prefix(prompt)[1] == 0 and engine.stats().host_kept >= 1
        result = run(engine, prompt[:37] + tiny_prompt(8, 10), exact=True)
        assert result.end.cached_tokens == 32 and engine.stats().restored_tokens == 32


def test_an_exact_pin_is_reusable_exactly(tiny_engine):
    prompt = tiny_prompt(9, 50)
    pin = tiny_engine.pin(prompt, exact=True)
    assert pin.result(timeout=60).end.cached_tokens == 0
    assert run(tiny_engine, prompt + tiny_prompt(10, 5), exact=True).end.cached_tokens == 48


# -- over HTTP -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(demo_model) -> Iterator[dict[str, str]]:
    """Three servers of the demo model (flash attention off): ``cold`` never sees the prefixes, ``warm`` and
    ``exact`` (``exact_prefix=True``, what ``kvrt serve --exact-prefix`` starts) cache them; their base URLs."""
    pytest.importorskip("fastapi", reason="the serve extra (pip install fastapi uvicorn openai) is not installed")
    from kvrt.serve.openai_server import OpenAIServer

    engines = {name: Engine(demo_model, CONFIG) for name in ("cold", "warm", "exact")}
    started = {name: OpenAIServer({"demo": engine}, exact_prefix=name == "exact") for name, engine in engines.items()}
    try:
        urls = {}
        for name, server in started.items():
            host, port = server.start("127.0.0.1", 0)
            urls[name] = f"http://{host}:{port}"
        yield urls
    finally:
        for server in started.values():
            server.stop()
        for engine in engines.values():
            engine.close()


def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: object) -> dict:
    """A greedy completion of token ids with its tokens and top-20 log-probabilities (a 200 expected)."""
    from test_openai_server import http_json

    status, answer = http_json("POST", url + "/v1/completions", {
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP,
        "return_tokens": True, **extra})
    assert status == 200, answer
    return answer


def cached_of(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def choice_of(answer: dict) -> tuple[str, list[int], dict]:
    choice = answer["choices"][0]
    return choice["text"], choice["tokens"], choice["logprobs"]


@pytest.fixture(scope="module")
def cold_answer(servers, prompt) -> dict:
    answer = complete(servers["cold"], prompt)
    assert cached_of(answer) == 0
    return answer


@pytest.mark.slow
def test_exact_prefix_over_http_equals_a_cold_server(servers, prompt, cold_answer):
    cached = PROMPT_TOKENS - 3
    complete(servers["warm"], prompt[:cached], max_tokens=1)
    plain = complete(servers["warm"], prompt)
    exact = complete(servers["warm"], prompt, exact_prefix=True)
    assert (cached_of(plain), cached_of(exact)) == (cached, UNIT)
    assert choice_of(exact) == choice_of(cold_answer)


@pytest.mark.slow
def test_the_servers_exact_prefix_is_what_a_request_gets_unless_it_says(servers, prompt, cold_answer):
    complete(servers["exact"], prompt[:PROMPT_TOKENS - 3], max_tokens=1)
    default = complete(servers["exact"], prompt)
    assert cached_of(default) == UNIT and choice_of(default) == choice_of(cold_answer)
    assert cached_of(complete(servers["exact"], prompt, exact_prefix=False)) == PROMPT_TOKENS - 1


def test_exact_prefix_is_a_bool_in_every_body(servers):
    from test_openai_server import http_json

    bodies = {"/v1/completions": {"prompt": "x"}, "/v1/chat/completions": {"messages": [{"role": "user",
                                                                                          "content": "x"}]},
              "/v1/responses": {"input": "x"}, "/v1/kvrt/pins": {"prompt": "x"}}
    for path, body in bodies.items():
        status, answer = http_json("POST", servers["warm"] + path, {"model": "demo", "exact_prefix": "yes", **body})
        assert (status, answer["error"]["param"]) == (400, "exact_prefix"), path


def test_exact_prefix_option_and_its_environment_variable(monkeypatch):
    from test_operator_http import parse_serve

    monkeypatch.delenv("KVRT_EXACT_PREFIX", raising=False)
    assert parse_serve([]).exact_prefix is False
    assert parse_serve(["--exact-prefix"]).exact_prefix is True
    monkeypatch.setenv("KVRT_EXACT_PREFIX", "1")
    assert parse_serve([]).exact_prefix is True
