"""The HTTP front's model pool (``--models-dir``): loads on demand, least-recently-used unloads, refusals with the
ledger's numbers, one load for concurrent first requests, and the load / unload routes.

In-process: an :class:`OpenAIServer` over a :class:`ModelPool` of three tiny test models (real llama.cpp), a
registry whose weight estimates come from a table (so every model's charge is known exactly) and a ledger whose
capacity holds two models with their engines' contexts, not three. Requests that must keep a model busy use pins
(a pin holds its model until unpinned), so nothing depends on timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _serving import http_call

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from kvrt.accounting.estimate import ModelShape, context_estimate  # noqa: E402
from kvrt.accounting.ledger import VramLedger  # noqa: E402
from kvrt.engine.generation import GenerationParams  # noqa: E402
from kvrt.errors import KvrtError  # noqa: E402
from kvrt.modelfiles.testmodels import write_model  # noqa: E402
from kvrt.runtime.admission import EngineConfig  # noqa: E402
from kvrt.runtime.batching import Engine  # noqa: E402
from kvrt.runtime.requests import Request  # noqa: E402
from kvrt.serve import model_pool  # noqa: E402
from kvrt.serve.http_front import HttpFront  # noqa: E402
from kvrt.serve.model_pool import ModelPool  # noqa: E402
from kvrt.serve.openai_server import OpenAIServer  # noqa: E402
from kvrt.serve.registry import ModelRegistry  # noqa: E402

WAIT_S = 60.0
WEIGHTS = 1 << 20  # every model's weight charge (the registry's table)
CONFIG = EngineConfig(n_ctx=512, n_seq_max=2, n_batch=64, flash_attn="off", host_bytes=0)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three tiny models (a, b, c: different weights) and a big one the table says needs more than the cap."""
    folder = tmp_path_factory.mktemp("models-dir")
    for seed, name in enumerate("abc"):
        write_model(folder / f"{name}.gguf", "tiny", seed=seed)
    write_model(folder / "big.gguf", "tiny", seed=3)
    return folder


def one_model_bytes(models_dir: Path) -> int:
    """What one loaded model costs the ledger: its weights (the table) and its engine's context (the estimate)."""
    shape = ModelShape.read(models_dir / "a.gguf")
    return WEIGHTS + context_estimate(shape, CONFIG.n_ctx, CONFIG.n_ubatch).total_bytes


class Served:
    """A server over a pool of ``models_dir`` with a ledger that holds two models; ``call`` speaks JSON to it."""

    def __init__(self, models_dir: Path) -> None:
        self.cap = 2 * one_model_bytes(models_dir) + one_model_bytes(models_dir) // 2
        self.ledger = VramLedger(self.cap)
        table = {f"{n}.gguf": WEIGHTS for n in "abc"} | {"big.gguf": self.cap}
        self.registry = ModelRegistry(self.ledger, table=table, measure=False)
        self.pool = ModelPool(self.registry, CONFIG, models_dir=models_dir)
        self.server = OpenAIServer(self.pool, default_max_tokens=8)
        self.host, self.port = self.server.start("127.0.0.1", 0)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return http_call(f"{self.host}:{self.port}", method, path, body)

    def complete(self, model: str) -> tuple[int, Any]:
        return self.call("POST", "/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 4,
                                                     "temperature": 0})

    def pin(self, model: str) -> str:
        status, pin = self.call("POST", "/v1/kvrt/pins", {"model": model, "prompt": [1, 2, 3, 4]})
        assert status == 200, pin
        return str(pin["id"])

    def owners(self) -> dict[str, int]:
        return self.ledger.snapshot().by_owner

    def resident(self) -> set[str]:
        return {entry.path.stem for entry in self.registry.models()}

    def close(self) -> None:
        HttpFront(self.server, (self.host, self.port), self.pool).close()
        self.registry.close()


@pytest.fixture()
def served(models_dir: Path) -> Iterator[Served]:
    served = Served(models_dir)
    try:
        yield served
    finally:
        served.close()
    assert served.ledger.allocated_bytes == 0  # everything the pool charged was given back


def loaded(served: Served) -> dict[str, bool]:
    status, listing = served.call("GET", "/v1/models")
    assert status == 200
    return {card["id"]: card["loaded"] for card in listing["data"]}


def test_every_gguf_is_listed_and_loaded_on_its_first_request(served: Served):
    assert loaded(served) == {"a": False, "b": False, "big": False, "c": False}
    assert served.ledger.allocated_bytes == 0 and not served.resident()
    status, reply = served.complete("a")
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    assert loaded(served) == {"a": True, "b": False, "big": False, "c": False}
    assert served.owners() == {"model:a.gguf": WEIGHTS, "http:a": one_model_bytes(served.pool.models_dir) - WEIGHTS}
    status, stats = served.call("GET", "/v1/kvrt/stats")
    assert stats["kvrt:models"]["a"]["loads"] == 1 and stats["a"]["n_cells"] > 0
    assert stats["kvrt:ledger"]["capacity_bytes"] == served.cap
    assert stats["kvrt:ledger"]["allocated_bytes"] == one_model_bytes(served.pool.models_dir)
    status, reply = served.complete("nope")
    assert status == 404 and reply["error"]["code"] == "model_not_found"


def test_the_least_recently_used_idle_model_makes_room(served: Served):
    for name in ("a", "b", "a"):  # a used last: b is the least recently used
        assert served.complete(name)[0] == 200
    status, reply = served.complete("c")  # a third does not fit under the cap
    assert status == 200, reply
    assert loaded(served) == {"a": True, "b": False, "big": False, "c": True}
    assert served.resident() == {"a", "c"}  # b's weights were freed: nothing else leased them
    assert not {owner for owner in served.owners() if owner.endswith(":b") or owner == "model:b.gguf"}
    assert served.call("GET", "/v1/kvrt/stats")[1]["kvrt:models"]["b"]["unloads"] == 1


def test_a_model_that_never_fits_is_refused_with_the_ledgers_numbers_and_nothing_unloaded(served: Served):
    assert served.complete("a")[0] == 200
    before = served.ledger.snapshot()
    status, reply = served.complete("big")
    assert status == 507 and reply["error"]["code"] == "insufficient_memory", reply
    message = reply["error"]["message"]
    assert "VRAM ledger denied http:big" in message and f"of max {served.cap} B" in message, message
    assert f"{before.allocated_bytes} B allocated" in message, message
    after = served.ledger.snapshot()
    assert after.reservations == before.reservations  # nothing of big stays charged, a was not unloaded for it
    assert served.resident() == {"a"} and loaded(served)["a"]


def test_when_busy_models_leave_no_room_the_request_is_refused_and_nothing_stays_charged(served: Served):
    pins = [served.pin("a"), served.pin("b")]  # a pin holds its model: neither may be unloaded
    before = served.ledger.snapshot()
    status, reply = served.complete("c")
    assert status == 507, reply
    message = reply["error"]["message"]
    assert "VRAM ledger denied http:c" in message and f"of max {served.cap} B" in message, message
    assert served.ledger.snapshot().reservations == before.reservations
    assert served.resident() == {"a", "b"} and not loaded(served)["c"]
    for pin in pins:
        assert served.call("DELETE", f"/v1/kvrt/pins/{pin}")[0] == 200
    assert served.complete("c")[0] == 200  # with the pins gone, a (least recently used) makes room
    assert served.resident() == {"b", "c"}


def test_concurrent_first_requests_load_the_model_once(served: Served, monkeypatch: pytest.MonkeyPatch):
    gate = threading.Event()
    acquire = served.registry.acquire

    def gated(path: Any) -> Any:
        assert gate.wait(WAIT_S), "the test never opened the gate"
        return acquire(path)

    monkeypatch.setattr(served.registry, "acquire", gated)
    replies: list[tuple[int, Any]] = []
    threads = [threading.Thread(target=lambda: replies.append(served.complete("a"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    limit = time.monotonic() + WAIT_S  # a bound on the wait, not an assertion on time
    while served.pool.describe()["a"]["load_waits"] < 3 and time.monotonic() < limit:
        time.sleep(0.01)
    gate.set()
    for thread in threads:
        thread.join(WAIT_S)
    assert [status for status, _ in replies] == [200] * 4, replies
    state = served.pool.describe()["a"]
    assert state["loads"] == 1 and state["load_waits"] == 3, state
    (entry,) = served.registry.models()
    assert entry.refcount == 1  # one lease: one engine


def test_the_routes_load_and_unload_and_unload_refuses_a_model_in_use(served: Served):
    status, card = served.call("POST", "/v1/kvrt/models/b/load")
    assert status == 200 and card["loaded"] and served.resident() == {"b"}
    pin = served.pin("b")
    status, reply = served.call("POST", "/v1/kvrt/models/b/unload")
    assert status == 409 and reply["error"]["code"] == "model_busy", reply
    assert "1 request(s) or pin(s) hold it" in reply["error"]["message"]
    assert served.resident() == {"b"} and "http:b" in served.owners()
    assert served.call("DELETE", f"/v1/kvrt/pins/{pin}")[0] == 200
    status, card = served.call("POST", "/v1/kvrt/models/b/unload")
    assert status == 200 and card["unloaded"] and not card["loaded"], card
    assert served.ledger.allocated_bytes == 0 and not served.resident()
    status, card = served.call("POST", "/v1/kvrt/models/b/unload")
    assert status == 200 and not card["unloaded"]
    assert served.call("POST", "/v1/kvrt/models/nope/unload")[0] == 404
    status, reply = served.call("POST", "/v1/kvrt/models/big/load")
    assert status == 507 and served.ledger.allocated_bytes == 0, reply


def test_an_http_unload_leaves_weights_another_user_leases(served: Served):
    """The registry is refcounted: the HTTP front's unload drops its lease, not the model another (a socket agent,
    here a lease taken directly) still holds."""
    other = served.registry.acquire(served.pool.models_dir / "a.gguf")
    try:
        assert served.complete("a")[0] == 200
        assert other.refcount == 2
        status, card = served.call("POST", "/v1/kvrt/models/a/unload")
        assert status == 200 and card["unloaded"]
        assert other.refcount == 1 and served.resident() == {"a"} and "model:a.gguf" in served.owners()
        assert "http:a" not in served.owners()
        assert other.model.tokenize("still here")  # the weights are alive
    finally:
        served.registry.release(other)


def test_a_models_dir_file_that_would_take_another_models_name_is_refused_at_start(models_dir: Path, tmp_path: Path):
    elsewhere = write_model(tmp_path / "a.gguf", "tiny", seed=9)
    registry = ModelRegistry(VramLedger(1 << 30), measure=False)
    with pytest.raises(KvrtError, match="two models would share the name 'a'"):
        ModelPool(registry, CONFIG, models={"a": elsewhere}, models_dir=models_dir)
    pool = ModelPool(registry, CONFIG, models={"a": models_dir / "a.gguf"}, models_dir=models_dir)  # the same file
    assert pool.names() == ["a", "b", "big", "c"]
    pool.close()


def test_a_file_that_fails_to_load_leaves_nothing_charged_and_is_tried_again(tmp_path: Path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(60))
    ledger = VramLedger(1 << 30)
    pool = ModelPool(ModelRegistry(ledger, measure=False), CONFIG, models_dir=tmp_path)
    try:
        first = pool.load("broken")
        assert isinstance(first.exception(WAIT_S), KvrtError)
        assert ledger.allocated_bytes == 0 and not pool.is_loaded("broken")
        assert pool.load("broken") is not first  # a new attempt, not the failed one's future
    finally:
        pool.close()


def test_the_engines_view_iterates_one_copy(served: Served):
    """/health, /metrics and /v1/kvrt/stats walk the loaded engines while models may unload: items() is one copy,
    never a mix of the names before and the engines after."""
    assert served.complete("a")[0] == 200
    items = served.pool.engines.items()
    assert served.pool.unload("a")
    assert [name for name, _ in items] == ["a"] and dict(served.pool.engines) == {}


def test_unload_refuses_while_the_engine_has_a_request_no_http_request_holds(served: Served,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """The engine's own queue counts too (a request submitted around the HTTP front, or one whose client has gone
    while the engine has not reaped it yet): its worker is stopped before each step until the test lets it go."""
    gate = threading.Event()

    def stopped_engine(*args: Any, **kwargs: Any) -> Engine:
        return Engine(*args, before_step=lambda: None if gate.wait(WAIT_S) else None, **kwargs)

    monkeypatch.setattr(model_pool, "Engine", stopped_engine)
    try:
        assert served.call("POST", "/v1/kvrt/models/a/load")[0] == 200
        engine = served.pool.engines["a"]
        engine.submit(Request([1, 2, 3], GenerationParams(max_tokens=2)))
        status, reply = served.call("POST", "/v1/kvrt/models/a/unload")
        assert status == 409 and "0 request(s) or pin(s) hold it; 1 queued" in reply["error"]["message"], reply
    finally:
        gate.set()
    limit = time.monotonic() + WAIT_S  # a bound on the wait, not an assertion on time
    while (engine.stats().queued or engine.stats().active) and time.monotonic() < limit:
        time.sleep(0.01)
    assert served.call("POST", "/v1/kvrt/models/a/unload")[0] == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_requests_hold_is_let_go_before_its_answer_ends(stream: bool):
    """A client that unloads right after an answer must find the model free: the hold goes before the last body
    message is sent (it went after, in the middleware's finally, and an unload just after a completion got 409)."""
    import asyncio

    from kvrt.serve.http_middleware import Observe

    held = ["model"]
    seen: list[tuple[bool, list[str]]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["state"]["kvrt"].releases.append(held.clear)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if stream:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            seen.append((message.get("more_body", False), list(held)))

    middleware = Observe(app, done=lambda *_: None)
    asyncio.run(middleware({"type": "http", "method": "POST", "path": "/v1/completions"}, None, send))
    assert seen[-1] == (False, [])  # released when the last body message went out
    assert all(still == ["model"] for more, still in seen if more)  # not before: a stream still uses the model
