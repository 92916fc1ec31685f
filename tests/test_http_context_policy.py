"""``--context-policy``: a prompt longer than a request's cells is refused (400 naming the limit, the default) or
shifted (its first ``keep_tokens`` and most recent tokens kept, the middle dropped), and a shifted answer says so.

In-process: two OpenAI servers over one engine of the tiny F32 test model (exact under batching and prefix reuse,
so a shifted request's output can be compared with the same server's answer to the shifted prompt sent as is).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from kvrt.runtime.admission import EngineConfig  # noqa: E402
from kvrt.runtime.batching import Engine  # noqa: E402
from kvrt.serve.context_policy import HEADER  # noqa: E402
from kvrt.serve.openai_server import OpenAIServer  # noqa: E402

WAIT_S = 60.0
CELLS = 512
KEEP = 4


@pytest.fixture(scope="module")
def servers(tiny_model) -> Iterator[dict[str, tuple[str, int]]]:
    """``{"refuse": address, "shift": address}``: the two policies over one engine of ``CELLS`` cells."""
    engine = Engine(tiny_model, EngineConfig(n_ctx=CELLS, n_seq_max=2, n_batch=64, flash_attn="off"))
    assert engine.n_cells == CELLS
    made = {"refuse": OpenAIServer({"tiny": engine}, default_max_tokens=8),
            "shift": OpenAIServer({"tiny": engine}, default_max_tokens=8, context_policy="shift", keep_tokens=KEEP)}
    try:
        yield {policy: server.start("127.0.0.1", 0) for policy, server in made.items()}
    finally:
        for server in made.values():
            server.stop()
        engine.close()


def post(address: tuple[str, int], body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    connection = http.client.HTTPConnection(*address, timeout=WAIT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps({"model": "tiny", "temperature": 0, **body}),
                           {"content-type": "application/json"})
        response = connection.getresponse()
        raw = response.read().decode()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, raw if body.get("stream") else json.loads(raw)
    finally:
        connection.close()


LONG = [5 + (i * 7) % 200 for i in range(600)]  # 600 token ids: more than the request's 512 cells


def test_refuse_is_the_default_and_names_the_limit(servers):
    status, headers, reply = post(servers["refuse"], {"prompt": LONG, "max_tokens": 8})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert f"{CELLS} cells" in reply["error"]["message"] and HEADER.lower() not in headers


def test_shift_keeps_the_head_and_the_most_recent_tokens_and_says_so(servers):
    status, headers, reply = post(servers["shift"], {"prompt": LONG, "max_tokens": 8})
    assert status == 200, reply
    kept = LONG[:KEEP] + LONG[len(LONG) - (CELLS - 8 - KEEP):]
    assert reply["usage"]["prompt_tokens"] == len(kept) == CELLS - 8
    assert reply["kvrt"]["context_shift"] == {"dropped_tokens": len(LONG) - len(kept), "prompt_tokens_before": 600,
                                              "prompt_tokens_after": len(kept), "keep_tokens": KEEP}
    assert headers[HEADER.lower()] == f"dropped={len(LONG) - len(kept)}; before=600; after={len(kept)}; keep={KEEP}"
    status, headers, direct = post(servers["shift"], {"prompt": kept, "max_tokens": 8})
    assert status == 200 and "kvrt" not in direct and HEADER.lower() not in headers  # it fits: not shifted
    assert reply["choices"][0]["text"] == direct["choices"][0]["text"]  # what was computed is the shifted prompt


def test_a_shifted_stream_says_so_in_its_header(servers):
    status, headers, raw = post(servers["shift"], {"prompt": LONG, "max_tokens": 8, "stream": True})
    assert status == 200 and raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    assert headers[HEADER.lower()].startswith(f"dropped={len(LONG) - (CELLS - 8)};"), headers


def test_a_long_text_is_tokenized_and_shifted_rather_than_refused_by_its_bytes(servers):
    text = "the quick brown fox jumps over the lazy dog " * 400  # far more bytes than the cells could hold
    assert post(servers["refuse"], {"prompt": text, "max_tokens": 8})[0] == 400
    status, _, reply = post(servers["shift"], {"prompt": text, "max_tokens": 8})
    assert status == 200 and reply["usage"]["prompt_tokens"] == CELLS - 8, reply
    assert reply["kvrt"]["context_shift"]["dropped_tokens"] > 0


def test_output_that_leaves_no_room_beside_the_kept_tokens_is_refused(servers):
    status, _, reply = post(servers["shift"], {"prompt": LONG, "max_tokens": CELLS - KEEP})
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    assert "--keep-tokens" in reply["error"]["message"]
