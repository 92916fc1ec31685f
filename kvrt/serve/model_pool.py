"""The HTTP front's models: which it can serve, which are loaded, loads on demand and least-recently-used unloads.

A model is a name (its GGUF file's stem) for a path: those named at start (``--model``, loaded then) and every
``*.gguf`` in a models directory (``--models-dir``, listed whether loaded or not, rescanned when a name is not
found or the list is asked for). A loaded model is an :class:`Engine` over a model leased from the process's
:class:`ModelRegistry` (shared by path and refcounted, so a socket agent on the same file keeps its weights when
the HTTP front lets go of them) with the engine's context charged to the registry's ledger.

Invariants:

* admission before allocation: a load checks that the model's weights (0 when the registry already holds them)
  and its engine's context fit together, reserves the context, then acquires the weights (which reserves before
  reading the file), and only then creates the context; a refusal at any step gives back what the load reserved,
  so a refused load leaves the ledger and the registry as they were (bar the idle models it unloaded to make room);
* one load at a time, on the pool's loader thread, never on the event loop: concurrent requests for one unloaded
  model share its one load, and two loads never race to unload the same models;
* a model is *busy* while an HTTP request holds it (:meth:`ModelPool.hold`: from the lookup until its answer's
  last body message, a stream's included; a pin holds it until unpinned) or while its engine has queued or running
  requests; a busy model is never unloaded, neither to make room nor by :meth:`ModelPool.unload`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, ItemsView, Iterator, Mapping, Sequence, ValuesView
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrt.accounting.devices import DeviceCharge
from kvrt.accounting.estimate import context_estimate
from kvrt.accounting.ledger import LedgerDenied, Reservation
from kvrt.engine.model import Model
from kvrt.errors import KvrtError
from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.runtime.host_tier import HostMemory
from kvrt.runtime.requests import EngineClosed
from kvrt.runtime.step_trace import StepTrace
from kvrt.serve.device_routing import route
from kvrt.serve.registry import LoadedModel, ModelRegistry
from kvrt.state.hostpool import host_memory

log = logging.getLogger("kvrt.serve.models")
RESERVED_PREFIX = "kvrt:"  # /v1/kvrt/stats keeps its own keys under it beside the models' names


class UnknownModel(KvrtError):
    """No model of that name: not given at start, not in the models directory."""


class ModelBusy(KvrtError):
    """The model cannot be unloaded now: requests or pins hold it, or it is loading."""


@dataclass
class _Replica:
    """A copy of a loaded model on another device (``--replicas``): its engine, its private weights, its context."""

    engine: Engine
    entry: LoadedModel
    context: Reservation | DeviceCharge


@dataclass
class _Loaded:
    """A loaded model: its engine, the registry lease and context charge behind it (``None`` for an engine the
    caller owns), the holds on it now, and when it was last held (a tick of the pool's clock: LRU order); its
    copies on other devices, held, used and unloaded with it."""

    engine: Engine
    entry: LoadedModel | None
    context: Reservation | DeviceCharge | None
    used: int
    holds: int = 0
    replicas: list[_Replica] = field(default_factory=list)

    def engines(self) -> dict[int, Engine]:
        """Every copy's engine by its device (the first copy's main device first)."""
        main = self.entry.placement.main if self.entry is not None and self.entry.placement is not None else 0
        return {main: self.engine, **{r.entry.placement.main: r.engine for r in self.replicas
                                      if r.entry.placement is not None}}


@dataclass
class _Counts:
    """What happened to one model: loads done, requests that joined a load already under way, unloads."""

    loads: int = 0
    load_waits: int = 0
    unloads: int = 0


class _LoadedEngines(Mapping[str, Engine]):
    """A live, read-only view of the loaded engines by name; iterating (keys, items, values) walks one copy taken
    under the pool's lock, so a model loaded or unloaded meanwhile never breaks it."""

    def __init__(self, pool: ModelPool) -> None:
        self._pool = pool

    def _copy(self) -> dict[str, Engine]:
        with self._pool._lock:
            return {name: loaded.engine for name, loaded in self._pool._loaded.items()}

    def __getitem__(self, name: str) -> Engine:
        return self._copy()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._copy())

    def __len__(self) -> int:
        return len(self._copy())

    def items(self) -> ItemsView[str, Engine]:  # one copy: a model unloaded meanwhile is never half-seen
        return self._copy().items()

    def values(self) -> ValuesView[Engine]:
        return self._copy().values()


class ModelPool:
    """The models an HTTP front serves (see the module docstring).

    ``models``: name -> path, loaded by :meth:`preload` (the caller's choice when); ``models_dir``: more, loaded
    on demand. ``registry`` and ``config`` make each engine (``host_memory`` gives its host tier's memory, pinned
    on a GPU by default). Use :meth:`fixed` for engines the caller made and keeps (no registry: nothing is loaded
    or unloaded). ``replicas`` (a registry on a device set only): each model loaded on up to that many devices,
    one copy of its weights and one engine each, a request going to the copy :meth:`route` picks.
    """

    def __init__(self, registry: ModelRegistry | None, config: EngineConfig, *,
                 models: Mapping[str, Path] | None = None, models_dir: Path | None = None,
                 host_memory: HostMemory = host_memory, step_trace_dir: Path | None = None,
                 replicas: int = 1) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise KvrtError(f"replicas must be an integer >= 1, got {replicas!r}")
        if replicas > 1 and (registry is None or registry.devices is None):
            raise KvrtError(f"{replicas} replicas of a model need a device set to put them on (kvrt serve --devices)")
        self.replicas = replicas
        self.registry = registry
        self.config = config
        self.models_dir = models_dir
        self.step_trace_dir = step_trace_dir
        if step_trace_dir is not None:  # refused before any model loads, not at the first engine
            try:
                step_trace_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise KvrtError(f"--step-trace {step_trace_dir}: {exc.strerror or exc}") from None
            if not os.access(step_trace_dir, os.W_OK):
                raise KvrtError(f"--step-trace {step_trace_dir}: not writable")
        self._host_memory = host_memory
        self._lock = threading.RLock()
        self._paths: dict[str, Path] = {}
        self._loaded: dict[str, _Loaded] = {}
        self._loading: dict[str, Future[None]] = {}
        self._counts: dict[str, _Counts] = {}
        self._clock = itertools.count(1)
        self._closing = False
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvrt-model-load")
        for name, path in (models or {}).items():
            self._add(name, Path(path))
        if models_dir is not None and not models_dir.is_dir():
            raise KvrtError(f"--models-dir {models_dir}: not a directory")
        self._scan(strict=True)
        self.engines: Mapping[str, Engine] = _LoadedEngines(self)

    @classmethod
    def fixed(cls, engines: Mapping[str, Engine]) -> ModelPool:
        """A pool of ``engines`` as given: all loaded, never unloaded, left open by :meth:`close` (the caller's)."""
        pool = cls(None, EngineConfig())
        for name, engine in engines.items():
            pool._add(name, engine.model.path)
            pool._loaded[name] = _Loaded(engine, None, None, next(pool._clock))
        return pool

    # -- names ---------------------------------------------------------------------------
    def _add(self, name: str, path: Path) -> None:
        if name.startswith(RESERVED_PREFIX):
            raise KvrtError(f"a model's name may not start with {RESERVED_PREFIX!r}: {path}")
        known = self._paths.get(name)
        if known is not None and known.resolve() != path.resolve():
            raise KvrtError(f"two models would share the name {name!r} (the file stem): {known} and {path}")
        self._paths[name] = path
        self._counts.setdefault(name, _Counts())

    def _scan(self, *, strict: bool = False) -> None:
        """Add the models directory's GGUF files not known yet (a file that went away stays known: loading it
        fails with the reason). ``strict`` (at start): a file whose name another model has, or may not be used,
        is an error; later such a file is skipped."""
        if self.models_dir is None:
            return
        with self._lock:
            for path in sorted(self.models_dir.glob("*.gguf")):
                known = self._paths.get(path.stem)
                if known is not None and known.resolve() == path.resolve():
                    continue
                if strict:
                    self._add(path.stem, path)  # raises, naming both files or the reserved prefix
                elif known is None and not path.stem.startswith(RESERVED_PREFIX):
                    self._add(path.stem, path)

    def names(self) -> list[str]:
        """Every model this pool can serve, loaded or not, sorted."""
        self._scan()
        with self._lock:
            return sorted(self._paths)

    def paths(self) -> dict[str, Path]:
        """Every model this pool can serve, name -> its GGUF file."""
        self._scan()
        with self._lock:
            return dict(self._paths)

    def is_loaded(self, name: str) -> bool:
        with self._lock:
            return name in self._loaded

    def _known(self, name: str) -> None:
        """Raise :class:`UnknownModel` unless ``name`` is a model here (lock held)."""
        if name not in self._paths:
            self._scan()
        if name not in self._paths:
            raise UnknownModel(f"the model {name!r} does not exist; this server has {sorted(self._paths)}")

    # -- use -----------------------------------------------------------------------------
    def hold(self, name: str) -> tuple[Engine, Callable[[], None]] | None:
        """The engine of ``name`` and the call that lets go of it (once; later calls do nothing), or ``None`` when
        it is not loaded (:meth:`load` it). While held it is never unloaded."""
        with self._lock:
            self._known(name)
            loaded = self._loaded.get(name)
            if loaded is None:
                return None
            loaded.holds += 1
            loaded.used = next(self._clock)
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    loaded.holds -= 1

        return loaded.engine, release

    def load(self, name: str) -> Future[None]:
        """A future done when ``name`` is loaded: at once if it is, the load under way if there is one, else a
        new load on the loader thread (making room by unloading idle models, least recently used first). Its
        exception: :class:`LedgerDenied` with the ledger's numbers when the model does not fit even then."""
        with self._lock:
            self._known(name)
            if self._closing:
                raise EngineClosed("the HTTP front is shutting down")
            if name in self._loaded:
                done: Future[None] = Future()
                done.set_result(None)
                return done
            under_way = self._loading.get(name)
            if under_way is not None:
                self._counts[name].load_waits += 1
                return under_way
            if self.registry is None:
                raise KvrtError(f"the model {name!r} was unloaded and this server cannot load models")
            future = self._loader.submit(self._load_and_keep, name)
            self._loading[name] = future
            return future

    def preload(self, name: str) -> None:
        """Load ``name`` now, on this thread, without unloading others (the models named at start)."""
        loaded = self._load_now(name, evict=False)
        with self._lock:
            self._loaded[name] = loaded
            self._counts[name].loads += 1

    def unload(self, name: str) -> bool:
        """Unload ``name`` now: its engine closed, its context's charge and its model lease given back (the weights
        stay where another user, e.g. a socket agent, leases them). False when it was not loaded; raises
        :class:`ModelBusy` while it is held, has queued or running requests, or is loading."""
        with self._lock:
            self._known(name)
            if name in self._loading:
                raise ModelBusy(f"the model {name!r} is loading")
            loaded = self._loaded.get(name)
            if loaded is None:
                return False
            if loaded.entry is None:
                raise ModelBusy(f"the model {name!r} was given to this server as an engine and cannot be unloaded")
            if not self._idle(loaded):
                stats = loaded.engine.stats()
                raise ModelBusy(f"the model {name!r} is in use ({loaded.holds} request(s) or pin(s) hold it; "
                                f"{stats.queued} queued, {stats.active} running)")
            del self._loaded[name]
            self._counts[name].unloads += 1
        self._free(loaded)
        log.info("unloaded model %s", name)
        return True

    # -- loading -------------------------------------------------------------------------
    def _load_and_keep(self, name: str) -> None:
        """The loader thread's job: load ``name`` and keep it, in one step with ending its load (so a request in
        between finds it loading or loaded, never neither)."""
        try:
            loaded = self._load_now(name, evict=True)
        except BaseException:
            with self._lock:
                del self._loading[name]
            raise
        with self._lock:
            del self._loading[name]
            if not self._closing:
                self._loaded[name] = loaded
                self._counts[name].loads += 1
                log.info("loaded model %s on demand", name)
                return
        self._free(loaded)
        raise EngineClosed("the HTTP front is shutting down")

    def _load_now(self, name: str, *, evict: bool) -> _Loaded:
        """Admit ``name``'s weights and context, unloading idle models (``evict``) until they fit, then load it."""
        registry = self.registry
        assert registry is not None
        path, config = self._paths[name], self.config
        while True:
            shape, weights = registry.peek(path)  # 0 weights: the registry holds them already
            cells = context_estimate(shape, config.n_ctx, config.n_ubatch).total_bytes
            try:
                entry, context = self._admit(name, path, weights, cells)
            except LedgerDenied:
                # not even empty ledgers would hold it: unload nothing for it
                if evict and not self._hopeless(weights + cells) and self._unload_lru(name):
                    continue
                raise
            try:
                engine = self._new_engine(entry.model, name)
            except BaseException:
                registry.give_back(context)
                registry.release(entry)
                raise
            loaded = _Loaded(engine, entry, context, next(self._clock))
            try:
                self._add_replicas(name, loaded)
            except BaseException:
                self._free(loaded)
                raise
            return loaded

    def _add_replicas(self, name: str, loaded: _Loaded) -> None:
        """Copies of ``name`` on other devices, one each, until ``replicas`` copies or no other device holds one
        whole (a copy is never split; a split model gets none); each copy's weights and context are charged to its
        device like a first load."""
        registry, entry = self.registry, loaded.entry
        assert registry is not None and entry is not None
        devices = registry.devices
        if self.replicas == 1 or devices is None or entry.placement is None or entry.placement.split:
            return
        shape, weights = registry.copy_estimate(entry.path)
        cells = context_estimate(shape, self.config.n_ctx, self.config.n_ubatch).total_bytes
        while len(loaded.replicas) + 1 < self.replicas:
            taken = set(loaded.engines())
            free = {d: f for d, f in devices.free_bytes().items() if d not in taken and f >= weights + cells}
            if not free:
                log.info("model %s: %d of %d replicas (no other device has %d B free)", name,
                         len(loaded.replicas) + 1, self.replicas, weights + cells)
                return
            placement = registry.policy.place(weights + cells, free, owner=f"http:{name}",
                                              snapshots=devices.snapshots())
            try:
                context = devices.reserve(placement.charges(cells), f"http:{name}@{placement.main}")
                try:
                    copy = registry.load_copy(entry.path, placement)
                except BaseException:
                    registry.give_back(context)
                    raise
            except LedgerDenied as denied:  # taken meanwhile (the socket front): fewer copies, not a failed load
                log.info("model %s: no replica on device %d: %s", name, placement.main, denied)
                return
            try:
                engine = self._new_engine(copy.model, f"{name}@{placement.main}")
            except BaseException:
                registry.give_back(context)
                registry.release(copy)
                raise
            loaded.replicas.append(_Replica(engine, copy, context))
            log.info("model %s: a replica on device %d", name, placement.main)

    def move_agent(self, name: str, agent: str, device: int) -> int:
        """Move ``agent``'s history between the copies of ``name`` (``--replicas``) to the one on ``device``: taken
        out of whichever copies keep it (:meth:`kvrt.runtime.batching.Engine.hand_over`) and put into that copy's
        host tier, so its next turn, routed by prefix affinity, restores it there instead of computing it again.
        Returns the tokens moved (0: no other copy kept any). Refused (:class:`KvrtError`): a model not loaded or
        with no copy on ``device``, an agent with a request running, a target with no host tier room (the history
        is then put back where it was)."""
        held = self.hold(name)
        if held is None:
            raise KvrtError(f"model {name!r} is not loaded")
        release = held[1]
        try:
            with self._lock:
                engines = self._loaded[name].engines()
            if device not in engines:
                raise KvrtError(f"model {name!r} has no copy on device {device}; its copies: {sorted(engines)}")
            moved = 0
            for source, engine in engines.items():
                if source == device:
                    continue
                taken = engine.hand_over(agent).result()
                if taken is None:
                    continue
                tokens, state = taken
                if not engines[device].preload(tokens, state, owner=agent).result():
                    engine.preload(tokens, state, owner=agent).result()
                    raise KvrtError(f"device {device}'s copy of {name!r} has no host tier room for agent {agent!r}'s "
                                    f"{state.nbytes} bytes of KV; it stays on device {source}")
                log.info("agent %r: %d tokens of history moved from device %d to %d", agent, len(tokens), source,
                         device)
                moved = max(moved, len(tokens))
            return moved
        finally:
            release()

    def _new_engine(self, model: Model, trace_name: str) -> Engine:
        """An engine of ``model`` with the pool's config and host memory, its steps traced to ``trace_name``.jsonl
        in the step trace folder (if any; closed again when the engine cannot be made)."""
        trace = StepTrace(self.step_trace_dir / f"{trace_name}.jsonl") if self.step_trace_dir is not None else None
        try:
            return Engine(model, self.config, host_memory=self._host_memory, trace=trace)
        except BaseException:
            if trace is not None:
                trace.close()
            raise

    def route(self, name: str, engine: Engine, tokens: Sequence[int]) -> Engine:
        """The copy of ``name`` that should serve a request of ``tokens``, ``engine`` being the one its hold gave:
        the one whose engine holds the longest prefix of them (an agent's history), else the least loaded
        (:mod:`kvrt.serve.device_routing`). ``engine`` itself where the model has one copy."""
        with self._lock:
            loaded = self._loaded.get(name)
        registry = self.registry
        if loaded is None or not loaded.replicas or loaded.engine is not engine or registry is None \
                or registry.devices is None:
            return engine
        engines = loaded.engines()
        return engines[route(engines, tokens, registry.policy, registry.devices.free_bytes())]

    def _admit(self, name: str, path: Path, weights: int, cells: int) -> tuple[LoadedModel, Reservation | DeviceCharge]:
        """Charge ``name``'s context and lease its weights (charged by the registry unless resident), or raise
        :class:`LedgerDenied` having changed nothing. On a device set the placement policy picks the device(s) for
        weights and context together; a resident model's context goes where its weights are."""
        registry = self.registry
        assert registry is not None
        owner = f"http:{name}"
        devices = registry.devices
        if devices is None:
            ledger = registry.ledger
            if not ledger.fits(weights + cells):
                snap = ledger.snapshot()
                raise LedgerDenied(owner=f"{owner} (weights {weights} B + context {cells} B)",
                                   max_bytes=snap.max_bytes, allocated_bytes=snap.allocated_bytes,
                                   request_bytes=weights + cells, external_bytes=snap.external_bytes)
            context: Reservation | DeviceCharge = ledger.try_reserve(cells, owner)
            try:
                return registry.acquire(path), context
            except BaseException:
                registry.give_back(context)
                raise
        if weights == 0:  # resident: its context goes with it
            entry = registry.acquire(path)
            try:
                return entry, registry.charge(entry, cells, owner)
            except BaseException:
                registry.release(entry)
                raise
        placement = registry.policy.place(weights + cells, devices.free_bytes(),
                                          owner=f"{owner} (weights {weights} B + context {cells} B)",
                                          snapshots=devices.snapshots())
        context = devices.reserve(placement.charges(cells), owner)
        try:
            entry = registry.acquire(path, placement)
            if entry.placement != placement:  # another front loaded it meanwhile, elsewhere: follow its weights
                registry.give_back(context)
                context = registry.charge(entry, cells, owner)
        except BaseException:
            registry.give_back(context)
            raise
        if entry.placement is not None:
            log.info("model %s placed on %s", name, entry.placement.describe())
        return entry, context

    def _hopeless(self, nbytes: int) -> bool:
        """Whether ``nbytes`` exceeds what the ledgers could admit with nothing of kvrt's on them."""
        registry = self.registry
        assert registry is not None
        snaps = registry.devices.snapshots().values() if registry.devices else [registry.ledger.snapshot()]
        return nbytes > sum(snap.max_bytes - snap.external_bytes for snap in snaps)

    def _unload_lru(self, keep: str) -> bool:
        """Unload the least recently used idle model other than ``keep``; False when there is none."""
        with self._lock:
            idle = [(loaded.used, name) for name, loaded in self._loaded.items()
                    if name != keep and loaded.entry is not None and self._idle(loaded)]
            if not idle:
                return False
            _, name = min(idle)
            loaded = self._loaded.pop(name)
            self._counts[name].unloads += 1
        self._free(loaded)
        log.info("unloaded model %s (least recently used) to make room for %s", name, keep)
        return True

    @staticmethod
    def _idle(loaded: _Loaded) -> bool:
        """No hold on it and nothing queued or running in its engines (lock held: no new hold can start)."""
        if loaded.holds:
            return False
        for engine in loaded.engines().values():
            stats = engine.stats()
            if stats.queued or stats.active:
                return False
        return True

    def _free(self, loaded: _Loaded) -> None:
        """Close the engine, then give its context's charge and its model lease back (not for a caller's engine)."""
        if loaded.entry is None or self.registry is None:
            return
        for replica in loaded.replicas:
            replica.engine.close()
            self.registry.give_back(replica.context)
            self.registry.release(replica.entry)
        loaded.replicas.clear()
        loaded.engine.close()
        if loaded.context is not None:
            self.registry.give_back(loaded.context)
        self.registry.release(loaded.entry)

    # -- state and shutdown ----------------------------------------------------------------
    def describe(self) -> dict[str, dict[str, Any]]:
        """Every model's state: loaded, loading, holds, and its loads, waits on a load and unloads so far."""
        self._scan()
        with self._lock:
            out = {}
            for name in sorted(self._paths):
                loaded, counts = self._loaded.get(name), self._counts[name]
                out[name] = {"loaded": loaded is not None, "loading": name in self._loading,
                             "holds": loaded.holds if loaded else 0, "loads": counts.loads,
                             "load_waits": counts.load_waits, "unloads": counts.unloads}
            return out

    def ledger_state(self) -> dict[str, Any] | None:
        """The ledger's numbers (None without a registry); on a device set, each device's under ``devices`` and
        where each loaded model is under ``placements``."""
        if self.registry is None:
            return None
        if self.registry.devices is not None:
            with self._lock:
                placements = {name: " + ".join([loaded.entry.placement.describe(),
                                                *(r.entry.placement.describe() for r in loaded.replicas
                                                  if r.entry.placement is not None)])
                              for name, loaded in self._loaded.items()
                              if loaded.entry is not None and loaded.entry.placement is not None}
            return {"devices": self.registry.devices.state(), "placements": placements}
        snap = self.registry.ledger.snapshot()
        return {"capacity_bytes": snap.max_bytes, "allocated_bytes": snap.allocated_bytes,
                "external_bytes": snap.external_bytes, "free_bytes": snap.free_bytes, "by_owner": snap.by_owner}

    def close_engines(self) -> None:
        """End every loaded engine's requests (streams get their final event); :meth:`close` frees them."""
        with self._lock:
            self._closing = True
            engines = [engine for loaded in self._loaded.values() if loaded.entry is not None
                       for engine in loaded.engines().values()]
        for engine in engines:
            engine.close()

    def close(self) -> None:
        """Wait for a load under way, then free every model this pool loaded (a caller's engines stay open)."""
        with self._lock:
            self._closing = True
        self._loader.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            loaded, self._loaded = list(self._loaded.values()), {}
        for one in loaded:
            self._free(one)
