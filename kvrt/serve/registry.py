"""Models shared by path with a reference count, admitted by the ledger before loading.

One process, one backend init (kvrt's bindings call ``llama_backend_init`` exactly once,
on first use), one copy of each GGUF's weights however many agents use it: the second
agent on a path costs a refcount increment, not another load. The order of operations
is lmxd's, kept strictly: estimate, reserve, load, correct. A load that fails after the
reservation releases it, so either the model is resident with bytes reserved or nothing
changed.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from kvrt.accounting.estimate import DeviceMeter, ModelShape
from kvrt.accounting.ledger import LedgerDenied, Reservation, VramLedger
from kvrt.engine.model import Model
from kvrt.errors import KvrtError


class RegistryError(KvrtError):
    """A model lease was misused (released twice, or never acquired)."""


@dataclass
class LoadedModel:
    """A resident model, its weight reservation and who is using it.

    ``estimated_bytes`` is what was reserved before loading (from the header or the
    operator's table); ``reservation.nbytes`` is what the ledger holds now, corrected to
    the measurement after loading.
    """

    path: Path
    model: Model
    shape: ModelShape
    reservation: Reservation
    estimated_bytes: int
    estimate_source: str
    refcount: int = 1
    measured_bytes: int | None = None


class ModelRegistry:
    """Load each model once, share it by resolved path, free it when the last user leaves.

    ``table`` is lmxd's ``model_vram`` table (:func:`kvrt.accounting.estimate.parse_vram_table`):
    an entry for a model's path (or file name) replaces the derived weight estimate.
    ``use_extra_bufts`` is passed to every :class:`Model` (``None``: the machine's verdict).
    ``measure``: on a GPU, correct each derived estimate to what the load took of the device's free
    memory (whole pages; schedulers do the same for contexts). Off, the estimates stand: the choice
    where other processes allocate on the same GPU meanwhile and would be counted as kvrt's.
    """

    def __init__(self, ledger: VramLedger, *, n_gpu_layers: int = -1, table: dict[str, int] | None = None,
                 use_extra_bufts: bool | None = None, measure: bool = True) -> None:
        self.ledger = ledger
        self.measure = measure
        self.n_gpu_layers = n_gpu_layers
        self.use_extra_bufts = use_extra_bufts
        self.table = dict(table or {})
        self._models: dict[Path, LoadedModel] = {}
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

    def acquire(self, path: str | os.PathLike[str]) -> LoadedModel:
        """The shared model at ``path``, loaded (after admission) on first use.

        Raises :class:`kvrt.accounting.ledger.LedgerDenied` before touching the file's weights when
        they do not fit, or the load error after releasing the reservation.
        """
        resolved = Path(path).resolve()
        with self._lock:
            entry = self._models.get(resolved)
            if entry is not None:
                entry.refcount += 1
                return entry
            shape = ModelShape.read(resolved)
            estimate, source = self._weight_estimate(resolved, shape)
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

    def release(self, entry: LoadedModel) -> None:
        """Drop one reference; the last one frees the model and its reservation."""
        with self._lock:
            if self._models.get(entry.path) is not entry or entry.refcount <= 0:
                raise RegistryError(f"model {entry.path.name} is not held by this registry (released twice?)")
            entry.refcount -= 1
            if entry.refcount == 0:
                del self._models[entry.path]
                entry.model.close()
                self.ledger.release(entry.reservation)

    def models(self) -> list[LoadedModel]:
        with self._lock:
            return list(self._models.values())

    def close(self) -> None:
        """Free every model regardless of references (process shutdown)."""
        with self._lock:
            for entry in self._models.values():
                entry.model.close()
                self.ledger.release(entry.reservation)
                entry.refcount = 0
            self._models.clear()
