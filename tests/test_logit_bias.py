"""``logit_bias``: kvrt's sampler stage and the HTTP field, checked against llama-cpp-python's logits.

The reference is the tiny test model's next-token logits from llama-cpp-python's high-level
``Llama`` (an independent path through llama.cpp), with the bias added in NumPy float64.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvrt.engine.sampling import Sampler, SamplingParams
from kvrt.errors import InvalidArgument, KvrtError

PROMPT = [1, 17, 42, 99, 7]
WAIT_S = 60.0


@pytest.fixture(scope="module")
def next_logits(tiny_model_path) -> np.ndarray:
    """The logits after PROMPT, from llama-cpp-python."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(tiny_model_path), n_ctx=64, logits_all=True, verbose=False)
    llm.eval(PROMPT)
    logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    llm.close()
    return logits


def test_params_normalise_a_mapping_to_sorted_pairs():
    params = SamplingParams(logit_bias={9: -1, 3: 2.5})  # type: ignore[arg-type]
    assert params.logit_bias == ((3, 2.5), (9, -1.0))


@pytest.mark.parametrize("bias", [((3, 1.0), (3, 2.0)), ((-1, 1.0),), ((3, float("nan")),), ((True, 1.0),)])
def test_bad_biases_are_refused(bias):
    with pytest.raises(InvalidArgument, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_a_bias_needs_the_vocabulary(tiny_model):
    with pytest.raises(KvrtError, match="logit biases"):
        Sampler(SamplingParams(logit_bias=((3, 1.0),)))
    with pytest.raises(InvalidArgument, match=f"token {tiny_model.n_vocab} is outside the vocabulary"):
        Sampler(SamplingParams(logit_bias=((tiny_model.n_vocab, 1.0),)), model=tiny_model)


@pytest.fixture(scope="module")
def served(tiny_model) -> Iterator[dict[str, Any]]:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from kvrt.runtime.admission import EngineConfig
    from kvrt.runtime.batching import Engine
    from kvrt.serve.openai_server import OpenAIServer

    engine = Engine(tiny_model, EngineConfig(n_ctx=256, n_seq_max=2, n_batch=64, flash_attn="off"))
    server = OpenAIServer({"tiny": engine})
    host, port = server.start("127.0.0.1", 0)
    try:
        yield {"host": host, "port": port}
    finally:
        server.stop()
        engine.close()


def post(served: dict[str, Any], path: str, body: dict[str, Any]) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(served["host"], served["port"], timeout=WAIT_S)
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def greedy_tokens(served: dict[str, Any], max_tokens: int, bias: dict[str, float] | None) -> list[int]:
    status, body = post(served, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True, "return_tokens": True,
                                                    **({"logit_bias": bias} if bias is not None else {})})
    assert status == 200, body
    return list(body["choices"][0]["tokens"])


def test_without_a_bias_the_greedy_token_is_the_references_argmax(served, next_logits):
    assert greedy_tokens(served, 1, None) == [int(np.argmax(next_logits))]


def test_minus_100_on_the_greedy_token_picks_the_biased_argmax(served, next_logits):
    best = int(np.argmax(next_logits))
    biased = next_logits.copy()
    biased[best] -= 100.0
    assert greedy_tokens(served, 1, {str(best): -100}) == [int(np.argmax(biased))] != [best]


def test_plus_100_on_one_token_makes_greedy_output_it(served, next_logits):
    least = int(np.argmin(next_logits))
    assert greedy_tokens(served, 4, {str(least): 100}) == [least] * 4


@pytest.mark.parametrize(("bias", "param"), [({"abc": 1}, "logit_bias.abc"), ({"5": 101}, "logit_bias.5"),
                                             ({"5": "1"}, "logit_bias.5"), ({"-3": 1}, "logit_bias.-3"),
                                             ({"1000000": 1}, "logit_bias.1000000")])
def test_a_bad_logit_bias_is_400_naming_the_key(served, bias, param):
    status, body = post(served, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "logit_bias": bias})
    assert status == 400
    assert body["error"]["param"] == param


def test_chat_bodies_carry_the_bias_into_the_engine_request():
    pytest.importorskip("pydantic")
    from kvrt.serve.openai_schema import ChatBody, engine_request, parse

    body = parse(ChatBody, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "logit_bias": {"7": 5, "2": -100}})
    job = engine_request(body, [1, 2, 3], n_cells=64, n_vocab=10, max_tokens=4, default_max_tokens=4, logprobs=None)
    assert job.params.sampling.logit_bias == ((2, -100.0), (7, 5.0))
