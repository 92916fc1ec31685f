"""Placement on emulated devices with real llama.cpp (CPU): the parameters a placement puts into
``llama_model_params``, the registry and the HTTP front's model pool charging the chosen device's ledger (a split
plan charging each device its share), refusals that leave nothing charged, the batched socket service's contexts
going where their model is, and prefix-affinity routing between two engines of one model on two devices.

On a CPU build llama.cpp accepts ``main_gpu`` / ``split_mode`` / ``tensor_split`` and places nothing, so what is
tested is what reaches ``llama_model_params`` and what each device's ledger is charged, never a fake GPU. Weight
charges come from a table (the registry's ``model_vram``) so every number is known exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from _serving import http_call
from kvrt.accounting.devices import DeviceLedgers, DevicesDenied
from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.accounting.ledger import VramLedger
from kvrt.accounting.placement import FreeMemoryPolicy, Placement
from kvrt.bindings import ffi, lib
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.model import SPLIT_MODES, Model, ModelParams
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import InvalidArgument, KvrtError
from kvrt.modelfiles.testmodels import write_model
from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import Request
from kvrt.serve.batched import BatchConfig, BatchedScheduler
from kvrt.serve.device_routing import route
from kvrt.serve.http_front import HttpFront
from kvrt.serve.model_pool import ModelBusy, ModelPool
from kvrt.serve.openai_server import OpenAIServer
from kvrt.serve.registry import ModelRegistry
from kvrt.serve.scheduler import Scheduler

WEIGHTS = 1 << 20
CONFIG = EngineConfig(n_ctx=512, n_seq_max=2, n_batch=64, flash_attn="off", host_bytes=0)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three tiny models (a, b, c: different weights) and ``big`` (the table makes it larger than one device)."""
    folder = tmp_path_factory.mktemp("device-models")
    for seed, name in enumerate(("a", "b", "c", "big")):
        write_model(folder / f"{name}.gguf", "tiny", seed=seed)
    return folder


def context_bytes(models_dir: Path) -> int:
    return context_estimate(ModelShape.read(models_dir / "a.gguf"), CONFIG.n_ctx, CONFIG.n_ubatch).total_bytes


def device_set(*capacities: int) -> DeviceLedgers:
    return DeviceLedgers({i: VramLedger(c) for i, c in enumerate(capacities)})


def registry_on(devices: DeviceLedgers, table: dict[str, int]) -> ModelRegistry:
    return ModelRegistry(devices.ledger(devices.indices[0]), table=table, measure=False, devices=devices)


def allocated(devices: DeviceLedgers) -> dict[int, int]:
    return {i: devices.ledger(i).allocated_bytes for i in devices.indices}


# -- what reaches llama_model_params -----------------------------------------------------------------------------------
def test_a_split_placement_reaches_llama_model_params_padded_to_every_device():
    plan = Placement((1, 0), (300, 100))
    params, keep = ModelParams(**plan.model_params()).to_c()
    assert params.main_gpu == 1 and params.split_mode == SPLIT_MODES["layer"]
    most = int(lib().llama_max_devices())
    split = [params.tensor_split[i] for i in range(most)]  # llama.cpp reads one per device it has: all must exist
    assert split[:2] == [0.25, 0.75] and split[2:] == [0.0] * (most - 2)
    assert keep == params.tensor_split


def test_a_single_device_placement_reaches_llama_model_params():
    params, keep = ModelParams(**Placement.on(2).model_params()).to_c()
    assert params.main_gpu == 2 and params.split_mode == SPLIT_MODES["none"] and params.tensor_split == ffi.NULL
    assert keep == ffi.NULL


def test_a_tensor_split_longer_than_llama_cpp_takes_is_refused():
    most = int(lib().llama_max_devices())
    with pytest.raises(KvrtError, match=f"tensor_split has {most + 1} proportions; this llama.cpp takes at most "
                                        f"{most} devices"):
        ModelParams(tensor_split=(1.0,) * (most + 1)).to_c()


def test_a_cpu_build_accepts_a_placement_and_computes_the_same(tiny_model_path: Path, tiny_model: Model):
    plan = Placement((1, 0), (1, 1))
    with Model(tiny_model_path, **plan.model_params()) as placed:
        assert (placed.params.main_gpu, placed.params.split_mode, placed.params.tensor_split) == (1, "layer",
                                                                                                   (0.5, 0.5))
        prompt = [1, 2, 3, 4, 5]
        config = EngineConfig(n_ctx=256, n_seq_max=1, n_batch=64, flash_attn="off", host_bytes=0)
        outputs = []
        for model in (placed, tiny_model):
            with Engine(model, config) as engine:
                request = Request(prompt, GenerationParams(max_tokens=6))
                outputs.append(engine.submit(request).result(WAIT_S).choices[0].tokens)
        assert outputs[0] == outputs[1]


# -- the registry ------------------------------------------------------------------------------------------------------
def test_models_go_to_the_device_with_the_most_room_and_are_charged_there(models_dir: Path):
    devices = device_set(3 * WEIGHTS, 4 * WEIGHTS)
    registry = registry_on(devices, {"a.gguf": WEIGHTS, "b.gguf": 2 * WEIGHTS})
    try:
        a = registry.acquire(models_dir / "a.gguf")  # 3 MiB vs 4 MiB free: device 1
        assert a.placement == Placement.on(1) and a.model.params.main_gpu == 1 and a.model.params.split_mode == "none"
        b = registry.acquire(models_dir / "b.gguf")  # now 3 MiB vs 3 MiB: the lowest index
        assert b.placement == Placement.on(0)
        assert allocated(devices) == {0: 2 * WEIGHTS, 1: WEIGHTS}
        assert devices.ledger(1).snapshot().by_owner == {"model:a.gguf": WEIGHTS}
        again = registry.acquire(models_dir / "a.gguf")  # shared where it is, nothing charged twice
        assert again is a and allocated(devices) == {0: 2 * WEIGHTS, 1: WEIGHTS}
        registry.release(again)
        registry.release(a)
        registry.release(b)
        assert allocated(devices) == {0: 0, 1: 0}
    finally:
        registry.close()


def test_a_model_bigger_than_one_device_is_split_and_each_device_charged_its_share(models_dir: Path):
    devices = device_set(4 * WEIGHTS, 2 * WEIGHTS)
    registry = registry_on(devices, {"big.gguf": 5 * WEIGHTS})
    try:
        big = registry.acquire(models_dir / "big.gguf")
        assert big.placement is not None and big.placement.split and big.placement.devices == (0, 1)
        assert big.model.params.split_mode == "layer" and big.model.params.main_gpu == 0
        assert big.model.params.tensor_split == pytest.approx((2 / 3, 1 / 3))
        charged = allocated(devices)
        assert charged == {0: 5 * WEIGHTS * 2 // 3, 1: 5 * WEIGHTS - 5 * WEIGHTS * 2 // 3}  # shares 2:1, exact sum
        registry.release(big)
        assert allocated(devices) == {0: 0, 1: 0}
    finally:
        registry.close()


def test_a_model_nothing_can_hold_is_refused_naming_each_device_and_nothing_stays_charged(models_dir: Path):
    devices = device_set(2 * WEIGHTS, 2 * WEIGHTS)
    registry = registry_on(devices, {"a.gguf": WEIGHTS, "big.gguf": 4 * WEIGHTS})
    try:
        a = registry.acquire(models_dir / "a.gguf")
        before = allocated(devices)
        with pytest.raises(DevicesDenied) as refused:
            registry.acquire(models_dir / "big.gguf")
        message = str(refused.value)
        assert f"device 0: {WEIGHTS} B free of max {2 * WEIGHTS} B ({WEIGHTS} B allocated)" in message
        assert f"device 1: {2 * WEIGHTS} B free of max {2 * WEIGHTS} B (0 B allocated)" in message
        assert allocated(devices) == before and [e.path.name for e in registry.models()] == ["a.gguf"]
        registry.release(a)
    finally:
        registry.close()


def test_an_emulated_devices_derived_charge_becomes_llama_cpps_size_by_the_shares(models_dir: Path):
    devices = device_set(2 << 20, 2 << 20)  # the tiny model's ~2.9 MB cannot sit on one: split
    registry = registry_on(devices, {})
    try:
        entry = registry.acquire(models_dir / "a.gguf")
        assert entry.estimate_source == "derived" and entry.placement is not None and entry.placement.split
        assert entry.measured_bytes == entry.model.size_bytes
        assert allocated(devices) == entry.placement.charges(entry.model.size_bytes)
        registry.release(entry)
        assert allocated(devices) == {0: 0, 1: 0}
    finally:
        registry.close()


def test_on_gpus_each_devices_charge_becomes_what_that_gpu_gave_up(models_dir: Path, monkeypatch):
    """llama.cpp's GPU readings replaced (a CPU machine has none): the load takes 300 B of GPU 0 and 100 B of GPU 1,
    and GPU 2, outside the placement, changes too; each device's reservation becomes its own reading."""
    from kvrt.serve import registry as registry_module
    from kvrt.system.gpu import Device

    free = [10**9, 10**9, 10**9]
    monkeypatch.setattr("kvrt.accounting.estimate.llama_gpu_devices", lambda: [
        Device(i + 1, f"CUDA{i}", "fake", "gpu", f, 10**9) for i, f in enumerate(free)])

    def loading(*args, **kwargs):
        model = Model(*args, **kwargs)
        free[0] -= 300
        free[1] -= 100
        free[2] -= 7
        return model

    monkeypatch.setattr(registry_module, "Model", loading)
    devices = DeviceLedgers({0: VramLedger(2 << 20), 1: VramLedger(2 << 20)})
    registry = ModelRegistry(devices.ledger(0), measure=True, devices=devices)
    try:
        entry = registry.acquire(models_dir / "a.gguf")
        assert entry.placement is not None and entry.placement.split
        assert allocated(devices) == {0: 300, 1: 100} and entry.measured_bytes == 400
        registry.release(entry)
        assert allocated(devices) == {0: 0, 1: 0}
    finally:
        registry.close()


def test_per_agent_contexts_refuse_a_device_set():
    devices = device_set(WEIGHTS)
    with pytest.raises(InvalidArgument, match="needs the batched service"):
        Scheduler(devices.ledger(0), registry_on(devices, {}))


# -- the HTTP front's pool ---------------------------------------------------------------------------------------------
@pytest.fixture()
def pool_on_devices(models_dir: Path) -> Iterator[tuple[ModelPool, DeviceLedgers]]:
    room = WEIGHTS + context_bytes(models_dir)  # one model with its engine's context
    devices = device_set(room + room // 2, room + room // 4)
    registry = registry_on(devices, {"a.gguf": WEIGHTS, "b.gguf": WEIGHTS, "c.gguf": WEIGHTS,
                                     "big.gguf": room + room // 2})
    pool = ModelPool(registry, CONFIG, models_dir=models_dir)
    try:
        yield pool, devices
    finally:
        pool.close()
        registry.close()
    assert allocated(devices) == {0: 0, 1: 0}


def test_the_pool_places_weights_and_context_together_on_a_device(pool_on_devices, models_dir: Path):
    pool, devices = pool_on_devices
    cells = context_bytes(models_dir)
    pool.load("a").result(WAIT_S)
    pool.load("b").result(WAIT_S)
    state = pool.ledger_state()
    assert state is not None and state["placements"] == {"a": "device 0", "b": "device 1"}
    assert state["devices"]["0"]["by_owner"] == {"http:a": cells, "model:a.gguf": WEIGHTS}
    assert state["devices"]["1"]["by_owner"] == {"http:b": cells, "model:b.gguf": WEIGHTS}
    held = pool.hold("b")
    assert held is not None
    engine, release = held
    assert engine.submit(Request([1, 2, 3], GenerationParams(max_tokens=3))).result(WAIT_S).choices[0].tokens
    release()


def test_the_pool_splits_what_one_device_cannot_hold(pool_on_devices, models_dir: Path):
    pool, devices = pool_on_devices
    pool.load("big").result(WAIT_S)  # 1.5 rooms + a context over 1.5 + 1.25 rooms: split by free memory
    state = pool.ledger_state()
    assert state is not None and state["placements"]["big"].startswith("split over device 0")
    charged = allocated(devices)
    assert all(0 < charged[d] <= devices.ledger(d).max_bytes for d in (0, 1))
    room = WEIGHTS + context_bytes(models_dir)
    assert sum(charged.values()) == room + room // 2 + context_bytes(models_dir)


def test_the_pool_refuses_with_every_device_and_unloads_only_idle_models(pool_on_devices, models_dir: Path):
    pool, devices = pool_on_devices
    pool.load("a").result(WAIT_S)
    held = pool.hold("a")  # busy: never unloaded to make room
    assert held is not None
    before = allocated(devices)
    with pytest.raises(DevicesDenied) as refused:
        pool.load("big").result(WAIT_S)
    assert "device 0:" in str(refused.value) and "device 1:" in str(refused.value)
    assert allocated(devices) == before and pool.is_loaded("a")
    held[1]()


def test_an_idle_model_is_unloaded_to_make_room_on_a_device_set(pool_on_devices, models_dir: Path):
    pool, devices = pool_on_devices
    pool.load("a").result(WAIT_S)  # device 0 (1.5 rooms), then b on device 1 (1.25 rooms)
    pool.load("b").result(WAIT_S)
    held = pool.hold("b")  # busy: never unloaded; a is idle
    assert held is not None
    pool.load("c").result(WAIT_S)  # 0.5 + 0.25 rooms left, not even split: a goes, c takes device 0
    assert not pool.is_loaded("a") and pool.is_loaded("b") and pool.is_loaded("c")
    state = pool.ledger_state()
    assert state is not None and state["placements"] == {"b": "device 1", "c": "device 0"}
    assert set(state["devices"]["0"]["by_owner"]) == {"model:c.gguf", "http:c"}
    assert pool.describe()["a"]["unloads"] == 1
    held[1]()


# -- the socket front's batched service --------------------------------------------------------------------------------
def test_a_batched_models_shared_context_is_charged_where_the_model_is(models_dir: Path):
    devices = device_set(64 * WEIGHTS, 64 * WEIGHTS)
    registry = registry_on(devices, {"a.gguf": WEIGHTS, "b.gguf": WEIGHTS})
    config = BatchConfig(n_ctx=512, n_seq_max=2, n_threads=1, flash_attn="off", host_bytes=0)
    try:
        with BatchedScheduler(devices.ledger(0), registry, config=config) as scheduler:
            scheduler.register("x", models_dir / "a.gguf", 256)
            scheduler.register("y", models_dir / "b.gguf", 256)
            owners = {d: devices.ledger(d).snapshot().by_owner for d in devices.indices}
            assert set(owners[0]) == {"model:a.gguf", "batch:a.gguf"}
            assert set(owners[1]) == {"model:b.gguf", "batch:b.gguf"}
            assert scheduler.decode("y", [1, 2, 3], 3).tokens
        assert allocated(devices) == {0: 0, 1: 0}
    finally:
        registry.close()


# -- prefix affinity ---------------------------------------------------------------------------------------------------
def test_an_agent_goes_to_the_device_that_holds_its_history(tiny_model_path: Path):
    config = EngineConfig(n_ctx=512, n_seq_max=2, n_batch=64, flash_attn="off", host_bytes=0)
    models = {d: Model(tiny_model_path, **Placement.on(d).model_params()) for d in (0, 1)}
    engines = {d: Engine(models[d], config) for d in (0, 1)}
    policy, free = FreeMemoryPolicy(), {0: 1 << 30, 1: 1 << 30}
    try:
        history = [1, 5, 9, 13, 17, 21, 25, 29]
        assert route(engines, history, policy, free) == 0  # nothing cached anywhere: the least loaded, lowest index
        turn = engines[1].submit(Request(history, GenerationParams(max_tokens=4), agent="ada")).result(WAIT_S)
        said = turn.choices[0].tokens
        next_turn = history + said + [7, 8]
        assert engines[1].cached_prefix(next_turn).result(WAIT_S) >= len(history)
        assert engines[0].cached_prefix(next_turn).result(WAIT_S) == 0
        assert route(engines, next_turn, policy, free) == 1  # where its history is, though both are idle
        assert route(engines, [2, 4, 6, 8], policy, free) == 0  # a stranger: least loaded, lowest index
        engines[1].close()  # closing: it holds nothing a request could use, and asking it fails nothing
        assert route(engines, next_turn, policy, free) == 0
    finally:
        for engine in engines.values():
            engine.close()
        for model in models.values():
            model.close()


# -- the pool's books on a device set, under random loads, holds and unloads ---------------------------------------
class PoolOnDevices(RuleBasedStateMachine):
    """Loads (unloading idle models least recently used first), holds, releases and unloads in any order, with real
    tiny models on two emulated devices: each device's reservations stay within its capacity, every loaded model's
    weights and context are charged on its placement's devices (by its shares) and nowhere else, a refusal charges
    nothing, and closing the pool gives every byte back."""

    models_dir: Path

    def __init__(self) -> None:
        super().__init__()
        room = WEIGHTS + context_bytes(self.models_dir)
        self.devices = device_set(room + room // 2, room + room // 4)
        self.registry = registry_on(self.devices, {"a.gguf": WEIGHTS, "b.gguf": WEIGHTS, "c.gguf": WEIGHTS,
                                                   "big.gguf": room + room // 2})
        self.pool = ModelPool(self.registry, CONFIG, models_dir=self.models_dir)
        self.holds: list[tuple[str, Any]] = []

    @rule(name=st.sampled_from(["a", "b", "c", "big"]))
    def load(self, name):
        before = allocated(self.devices)
        try:
            self.pool.load(name).result(WAIT_S)
        except DevicesDenied:  # idle models may have been unloaded for it; nothing of it stays charged
            assert not self.pool.is_loaded(name)
            assert all(allocated(self.devices)[d] <= before[d] for d in before)
            return
        assert self.pool.is_loaded(name)

    @rule(name=st.sampled_from(["a", "b", "c", "big"]))
    def hold(self, name):
        held = self.pool.hold(name)
        if held is not None:
            self.holds.append((name, held[1]))

    @precondition(lambda self: self.holds)
    @rule(pick=st.integers(0, 100))
    def let_go(self, pick):
        _, release = self.holds.pop(pick % len(self.holds))
        release()

    @rule(name=st.sampled_from(["a", "b", "c", "big"]))
    def unload(self, name):
        busy = any(n == name for n, _ in self.holds)
        try:
            self.pool.unload(name)
        except ModelBusy:
            assert busy
            return
        assert not busy and not self.pool.is_loaded(name)

    @invariant()
    def books(self):
        expected = {d: 0 for d in self.devices.indices}
        cells = context_bytes(self.models_dir)
        for entry in self.registry.models():
            assert entry.placement is not None
            for device, nbytes in entry.placement.charges(entry.reservation.nbytes).items():
                expected[device] += nbytes
            for device, nbytes in entry.placement.charges(cells).items():
                expected[device] += nbytes  # the pool's engine context: every resident model here is loaded
        assert allocated(self.devices) == expected
        for device in self.devices.indices:
            assert self.devices.ledger(device).allocated_bytes <= self.devices.ledger(device).max_bytes

    def teardown(self):
        for _, release in self.holds:
            release()
        self.pool.close()
        self.registry.close()
        assert allocated(self.devices) == {0: 0, 1: 0}


def test_the_pools_books_on_a_device_set_hold_under_any_sequence(models_dir: Path):
    PoolOnDevices.models_dir = models_dir
    run_state_machine_as_test(PoolOnDevices, settings=settings(max_examples=30, stateful_step_count=15,
                                                                 deadline=None))


# -- replicas: a model on several devices, an agent's request to the copy that holds its history ----------------------
class Replicated:
    """An OpenAI server over a pool with up to two copies of every model on two emulated devices of 4 and 5 rooms
    (a room: ``a``'s weights and its engine's context); ``b`` needs 3.5 rooms, so one copy of it at most."""

    def __init__(self, models_dir: Path, config: EngineConfig = CONFIG) -> None:
        room = WEIGHTS + context_bytes(models_dir)
        self.devices = device_set(4 * room, 5 * room)
        self.registry = registry_on(self.devices, {"a.gguf": WEIGHTS,
                                                   "b.gguf": 3 * room + room // 2 - context_bytes(models_dir)})
        self.pool = ModelPool(self.registry, config, models_dir=models_dir, replicas=2)
        self.server = OpenAIServer(self.pool, default_max_tokens=4)
        self.host, self.port = self.server.start("127.0.0.1", 0)

    def complete(self, model: str, prompt: list[int], agent: str) -> dict[str, Any]:
        status, reply = http_call(f"{self.host}:{self.port}", "POST", "/v1/completions",
                                  {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                   "return_tokens": True},
                                  {"X-Kvrt-Agent": agent})
        assert status == 200, reply
        return dict(reply)

    def engines(self, name: str) -> dict[int, Engine]:
        return self.pool._loaded[name].engines()

    def close(self) -> None:
        HttpFront(self.server, (self.host, self.port), self.pool).close()
        self.registry.close()


@pytest.fixture()
def replicated(models_dir: Path) -> Iterator[Replicated]:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    served = Replicated(models_dir)
    try:
        yield served
    finally:
        served.close()
    assert allocated(served.devices) == {0: 0, 1: 0}


def test_replicas_are_copies_on_other_devices_each_charged_there(replicated: Replicated, models_dir: Path):
    replicated.pool.load("a").result(WAIT_S)
    cells = context_bytes(models_dir)
    state = replicated.pool.ledger_state()
    assert state is not None and state["placements"] == {"a": "device 1 + device 0"}  # 5 rooms first, then 4
    assert state["devices"]["1"]["by_owner"] == {"model:a.gguf": WEIGHTS, "http:a": cells}
    assert state["devices"]["0"]["by_owner"] == {"model:a.gguf@0": WEIGHTS, "http:a@0": cells}
    assert set(replicated.engines("a")) == {0, 1}
    assert [e.path.name for e in replicated.registry.models()] == ["a.gguf", "a.gguf"]  # a private copy besides
    assert replicated.pool.unload("a") and allocated(replicated.devices) == {0: 0, 1: 0}


def test_an_agents_next_turn_goes_to_the_device_that_holds_its_history(replicated: Replicated):
    history = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37]
    replicated.complete("a", history, "ada")  # nothing cached anywhere, both idle: the most free, device 1
    engines = replicated.engines("a")
    assert engines[1].cached_prefix(history).result(WAIT_S) == len(history)
    assert engines[0].cached_prefix(history).result(WAIT_S) == 0
    replicated.pool.load("b").result(WAIT_S)  # one copy, on device 1 (4 rooms free there, 3 on device 0)
    assert replicated.pool.ledger_state()["placements"]["b"] == "device 1"  # type: ignore[index]
    stranger = [2, 4, 6, 8, 10, 12]
    replicated.complete("a", stranger, "bob")  # no history: equally idle, device 0 has the most free
    assert engines[0].cached_prefix(stranger).result(WAIT_S) == len(stranger)
    reused = engines[1].stats().reused_tokens
    replicated.complete("a", history + [41, 45], "ada")  # device 0 would win on the numbers; its history is on 1
    assert engines[1].stats().reused_tokens >= reused + len(history)
    assert engines[0].cached_prefix(history).result(WAIT_S) == 0


def test_an_agent_moved_to_another_device_goes_on_token_for_token(models_dir: Path):
    """The agent's history taken out of device 1's copy and put into device 0's host tier: its next turn is routed
    there, restores all of it, and answers what a fresh context computing the whole prompt answers (the tiny F32
    model with flash attention off is exact under batching and restores)."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    served = Replicated(models_dir, replace(CONFIG, host_bytes=16 << 20))
    try:
        history = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37]
        first = served.complete("a", history, "ada")["choices"][0]["tokens"]
        engines = served.engines("a")
        assert engines[1].cached_prefix(history).result(WAIT_S) == len(history)  # the most free device first
        address = f"{served.host}:{served.port}"
        status, error = http_call(address, "POST", "/v1/kvrt/agents/ada/move", {"model": "a", "device": 7})
        assert status == 400 and "no copy on device 7" in error["error"]["message"], error
        assert http_call(address, "POST", "/v1/kvrt/agents/a%20b/move", {"model": "a", "device": 0})[0] == 400
        assert http_call(address, "POST", "/v1/kvrt/agents/ada/move", {"model": "zz", "device": 0})[0] == 404
        assert http_call(address, "POST", "/v1/kvrt/agents/ada/move", {"model": "b", "device": 0})[0] == 409
        status, moved = http_call(address, "POST", "/v1/kvrt/agents/ada/move", {"model": "a", "device": 0})
        assert status == 200 and moved["moved_tokens"] == len(history) + len(first) - 1, moved  # last not decoded
        assert engines[1].cached_prefix(history).result(WAIT_S) == 0
        assert served.pool.move_agent("a", "nobody", 0) == 0
        restored = engines[0].stats().restored_tokens
        turn = history + first + [41, 45]
        second = served.complete("a", turn, "ada")["choices"][0]["tokens"]
        assert engines[0].stats().restored_tokens - restored == len(history) + len(first) - 1
        with Model(models_dir / "a.gguf", n_gpu_layers=0) as model, Context(model, n_ctx=512, flash_attn="off") as ctx:
            assert second == generate(ctx, turn, GenerationParams(max_tokens=3, sampling=SamplingParams(
                temperature=0.0))).tokens
    finally:
        served.close()


def test_replicas_need_a_device_set(models_dir: Path):
    registry = ModelRegistry(VramLedger(1 << 30), measure=False)
    with pytest.raises(KvrtError, match="2 replicas of a model need a device set"):
        ModelPool(registry, CONFIG, models_dir=models_dir, replicas=2)
