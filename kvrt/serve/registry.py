"""Models shared by path with a reference count, admitted by the ledger before loading.

One process, one backend init (kvrt's bindings call ``llama_backend_init`` exactly once,
on first use), one copy of each GGUF's weights however many agents use it: the second
agent on a path costs a refcount increment, not another load. The order of operations
is lmxd's, kept strictly: estimate, reserve, load, correct. A load that fails after the
reservation releases it, so either the model is resident with bytes reserved or nothing
changed.

With a device set (:class:`~kvrt.accounting.devices.DeviceLedgers`) a first load is placed: on the device its
caller chose (the HTTP front's pool, which places weights and context together) or where the placement policy
puts the weights, loaded with that placement's ``main_gpu`` / ``split_mode`` / ``tensor_split`` and its weights
charged to each device's ledger by the placement's shares (all or nothing). A model is still loaded once: a later
acquire of a resident path shares the copy already placed, wherever it is.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from kvrt.accounting.devices import DeviceCharge, DeviceLedgers
from kvrt.accounting.estimate import DeviceMeter, ModelShape
from kvrt.accounting.ledger import LedgerDenied, Reservation, VramLedger
from kvrt.accounting.placement import FreeMemoryPolicy, Placement, PlacementPolicy
from kvrt.engine.model import Model
from kvrt.errors import KvrtError


class RegistryError(KvrtError):
    """A model lease was misused (released twice, or never acquired)."""


@dataclass
class LoadedModel:
    """A resident model, its weight reservation and who is using it.

    ``estimated_bytes`` is what was reserved before loading (from the header or the
    operator's table); ``reservation.nbytes`` is what the ledger holds now, corrected to
    the measurement after loading. On a device set ``reservation`` is a :class:`DeviceCharge` (one receipt per
    device of ``placement``) and ``placement`` says where the model is.
    """

    path: Path
    model: Model
    shape: ModelShape
    reservation: Reservation | DeviceCharge
    estimated_bytes: int
    estimate_source: str
    refcount: int = 1
    measured_bytes: int | None = None
    placement: Placement | None = None


class ModelRegistry:
    """Load each model once, share it by resolved path, free it when the last user leaves.

    ``table`` is lmxd's ``model_vram`` table (:func:`kvrt.accounting.estimate.parse_vram_table`):
    an entry for a model's path (or file name) replaces the derived weight estimate.
    ``use_extra_bufts`` is passed to every :class:`Model` (``None``: the machine's verdict).
    ``measure``: on a GPU, correct each derived estimate to what the load took of the device's free
    memory (whole pages; schedulers do the same for contexts). Off, the estimates stand: the choice
    where other processes allocate on the same GPU meanwhile and would be counted as kvrt's.
    ``devices``: place models over these devices (``policy`` decides where; see the module docstring); ``ledger``
    is then the ledger single-ledger callers read, one of the set's. There a derived estimate is corrected per
    device: to what each GPU gave up (``measure``), or on emulated devices llama.cpp's size by the placement's shares.
    """

    def __init__(self, ledger: VramLedger, *, n_gpu_layers: int = -1, table: dict[str, int] | None = None,
                 use_extra_bufts: bool | None = None, measure: bool = True, devices: DeviceLedgers | None = None,
                 policy: PlacementPolicy | None = None) -> None:
        if devices is not None and all(devices.ledger(i) is not ledger for i in devices.indices):
            raise RegistryError("a registry on a device set reads one of the set's ledgers as its ledger")
        self.ledger = ledger
        self.devices = devices
        self.policy: PlacementPolicy = policy or FreeMemoryPolicy()
        self.measure = measure
        self.n_gpu_layers = n_gpu_layers
        self.use_extra_bufts = use_extra_bufts
        self.table = dict(table or {})
        self._models: dict[Path, LoadedModel] = {}
        self._copies: list[LoadedModel] = []  # replicas: private copies on other devices, never shared
        self._lock = threading.RLock()
        self._on_gpu: bool | None = None

    @property
    def on_gpu(self) -> bool:
        """Whether llama.cpp places weights on a GPU here (decides which bytes count)."""
        if self._on_gpu is None:
            self._on_gpu = DeviceMeter.gpu_present()
        return self._on_gpu

    def _weight_estimate(self, path: Path, shape: ModelShape) -> tuple[int, str]:
        for key in (str(path), path.name):
            if key in self.table:
                return self.table[key], "table"
        return shape.weight_bytes(self.n_gpu_layers, on_gpu=self.on_gpu), "derived"

    def peek(self, path: str | os.PathLike[str]) -> tuple[ModelShape, int]:
        """The header and the weight bytes a first acquire would reserve (0 when resident)."""
        resolved = Path(path).resolve()
        with self._lock:
            entry = self._models.get(resolved)
            if entry is not None:
                return entry.shape, 0
        shape = ModelShape.read(resolved)
        return shape, self._weight_estimate(resolved, shape)[0]

    def copy_estimate(self, path: str | os.PathLike[str]) -> tuple[ModelShape, int]:
        """The header and the weight bytes a :meth:`load_copy` of ``path`` would reserve (resident or not)."""
        resolved = Path(path).resolve()
        shape = ModelShape.read(resolved)
        return shape, self._weight_estimate(resolved, shape)[0]

    def acquire(self, path: str | os.PathLike[str], placement: Placement | None = None) -> LoadedModel:
        """The shared model at ``path``, loaded (after admission) on first use.

        On a device set a first load goes to ``placement`` (``None``: where the policy puts its weights); a resident
        model is shared wherever it is. Raises :class:`kvrt.accounting.ledger.LedgerDenied` (on a device set its
        :class:`~kvrt.accounting.devices.DevicesDenied`, naming every device) before touching the file's weights
        when they do not fit, or the load error after releasing the reservation.
        """
        resolved = Path(path).resolve()
        with self._lock:
            entry = self._models.get(resolved)
            if entry is not None:
                entry.refcount += 1
                return entry
            shape = ModelShape.read(resolved)
            estimate, source = self._weight_estimate(resolved, shape)
            if self.devices is not None:
                entry = self._models[resolved] = self._load_placed(resolved, shape, estimate, source, placement)
                return entry
            if placement is not None:
                raise RegistryError(f"{resolved.name}: a placement needs a registry on a device set")
            reservation = self.ledger.try_reserve(estimate, f"model:{resolved.name}")
            try:
                meter = DeviceMeter(self.measure)
                model = Model(resolved, n_gpu_layers=self.n_gpu_layers, use_extra_bufts=self.use_extra_bufts)
            except BaseException:
                self.ledger.release(reservation)
                raise
            measured = meter.delta()
            if measured is None and not self.on_gpu:
                measured = model.size_bytes  # llama.cpp's own count of what it holds in memory
            entry = LoadedModel(resolved, model, shape, reservation, estimate, source, measured_bytes=measured)
            if measured is not None and source == "derived":
                try:
                    self.ledger.resize(reservation, measured)
                except LedgerDenied:
                    pass  # loading took more than admitted and the rest is taken: keep the estimate, drift shows it
            self._models[resolved] = entry
            return entry

    def _load_placed(self, path: Path, shape: ModelShape, estimate: int, source: str,
                     placement: Placement | None) -> LoadedModel:
        """Place (unless the caller did), charge every device its share, load with the placement's parameters (lock
        held); a failed load gives every device's share back."""
        devices = self.devices
        assert devices is not None
        owner = f"model:{path.name}"
        if placement is None:
            placement = self.policy.place(estimate, devices.free_bytes(), owner=owner, snapshots=devices.snapshots())
        return self._placed(path, shape, estimate, source, placement, owner)

    def _placed(self, path: Path, shape: ModelShape, estimate: int, source: str, placement: Placement,
                owner: str) -> LoadedModel:
        """Charge every device of ``placement`` its share, load, correct the charges (lock held); not recorded."""
        devices = self.devices
        assert devices is not None
        charge = devices.reserve(placement.charges(estimate), owner)
        try:
            meter = DeviceMeter(self.measure)
            model = Model(path, n_gpu_layers=self.n_gpu_layers, use_extra_bufts=self.use_extra_bufts,
                          **placement.model_params())
        except BaseException:
            devices.release(charge)
            raise
        measured = meter.delta_by_device()
        if measured is None and not self.on_gpu:  # emulated devices: llama.cpp's count, by the placement's shares
            measured = placement.charges(model.size_bytes)
        taken = {device: measured.get(device, 0) for device in charge} if measured is not None else None
        entry = LoadedModel(path, model, shape, charge, estimate, source, placement=placement,
                            measured_bytes=sum(taken.values()) if taken is not None else None)
        if taken is not None and source == "derived":
            for device, reservation in charge.items():
                try:
                    devices.ledger(device).resize(reservation, taken[device])
                except LedgerDenied:
                    pass  # that device gave more than admitted and the rest is taken: its estimate stays
        return entry

    def load_copy(self, path: str | os.PathLike[str], placement: Placement) -> LoadedModel:
        """A private copy of ``path``'s model at ``placement`` (a replica on another device: its own weights,
        charged there like a first load), never handed out by :meth:`acquire`; :meth:`release` frees it."""
        if self.devices is None:
            raise RegistryError(f"{Path(path).name}: a copy on another device needs a registry on a device set")
        resolved = Path(path).resolve()
        with self._lock:
            shape = ModelShape.read(resolved)
            estimate, source = self._weight_estimate(resolved, shape)
            owner = f"model:{resolved.name}@{placement.main}"
            entry = self._placed(resolved, shape, estimate, source, placement, owner)
            self._copies.append(entry)
            return entry

    def charge(self, entry: LoadedModel, nbytes: int, owner: str) -> Reservation | DeviceCharge:
        """Charge ``nbytes`` more of ``entry``'s memory (a context: its KV sits with its layers) where the model
        is: the registry's ledger, or each device of its placement by its share (all or nothing)."""
        if entry.placement is None or self.devices is None:
            return self.ledger.try_reserve(nbytes, owner)
        return self.devices.reserve(entry.placement.charges(nbytes), owner)

    def give_back(self, charge: Reservation | DeviceCharge) -> None:
        """Release a charge from :meth:`charge` (or a model's weights) on whichever ledgers hold it."""
        if isinstance(charge, DeviceCharge):
            assert self.devices is not None
            self.devices.release(charge)
        else:
            self.ledger.release(charge)

    def release(self, entry: LoadedModel) -> None:
        """Drop one reference; the last one frees the model and its reservation."""
        with self._lock:
            if any(copy is entry for copy in self._copies):
                self._copies = [copy for copy in self._copies if copy is not entry]
                entry.refcount = 0
                entry.model.close()
                self.give_back(entry.reservation)
                return
            if self._models.get(entry.path) is not entry or entry.refcount <= 0:
                raise RegistryError(f"model {entry.path.name} is not held by this registry (released twice?)")
            entry.refcount -= 1
            if entry.refcount == 0:
                del self._models[entry.path]
                entry.model.close()
                self.give_back(entry.reservation)

    def models(self) -> list[LoadedModel]:
        with self._lock:
            return [*self._models.values(), *self._copies]

    def close(self) -> None:
        """Free every model regardless of references (process shutdown)."""
        with self._lock:
            for entry in [*self._models.values(), *self._copies]:
                entry.model.close()
                self.give_back(entry.reservation)
                entry.refcount = 0
            self._models.clear()
            self._copies.clear()
