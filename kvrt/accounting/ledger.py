"""The VRAM ledger: admission control by honest bookkeeping, checked before anything allocates.

lmxd's rule, kept: admit a request only if ``allocated + request <= max`` where ``max``
is the admission percent (default 90) of the device's total memory, compared and
committed under one lock. What kvrt adds:

* reservations are *owned*, read-only receipts (``model:…``, ``agent:…``, ``pool:…``)
  released exactly once, so a snapshot says who holds what and a double release is an
  error instead of silently freeing someone else's bytes; the ledger keeps its own
  record of each receipt and never reads the books from one, and it refuses a receipt
  of another ledger;
* sizes are validated (a bool, a float, a negative or a value past 64 bits is refused
  with the offending value in the message);
* the ledger re-reads the device (NVML) on a timer and on demand: memory used by other
  processes counts against admission, and the drift between what the ledger believes
  and what the device reports is published in :meth:`VramLedger.snapshot`.

Where NVML sees no GPU the ledger runs on a configured byte capacity, so everything
above it (registry, scheduler, daemon) behaves the same on a CPU machine.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvrt.checks import check_int, check_real, shown
from kvrt.errors import KvrtError
from kvrt.system.gpu import nvidia_gpu_count

U64_MAX = 2**64 - 1
DEFAULT_ADMIT_PERCENT = 90.0


class LedgerError(KvrtError):
    """A ledger call was given an invalid size or an unknown/released reservation."""


class LedgerDenied(KvrtError):
    """Admission refused: the request does not fit under the cap. Nothing was changed.

    Carries the numbers of lmxd's reply (``max_bytes``, ``allocated_bytes``,
    ``request_bytes``) plus ``external_bytes``, the device memory other processes held
    at the last reconciliation (lmxd never sees those).
    """

    code = "CAP"

    def __init__(self, *, owner: str, max_bytes: int, allocated_bytes: int, request_bytes: int,
                 external_bytes: int = 0) -> None:
        self.owner = owner
        self.max_bytes = max_bytes
        self.allocated_bytes = allocated_bytes
        self.request_bytes = request_bytes
        self.external_bytes = external_bytes
        free = max_bytes - allocated_bytes - external_bytes
        super().__init__(
            f"VRAM ledger denied {owner}: request {request_bytes} B does not fit; {allocated_bytes} B allocated"
            + (f" + {external_bytes} B held by other processes" if external_bytes else "")
            + f" of max {max_bytes} B leaves {max(free, 0)} B"
        )


class Reservation:
    """A read-only receipt for bytes held by one owner; hand it back to :meth:`VramLedger.release` once.

    ``nbytes`` and ``owner`` show what the issuing ledger holds (after :meth:`~VramLedger.resize`
    and :meth:`~VramLedger.transfer`) and cannot be assigned. The ledger never reads its
    books from a receipt: it keeps its own record per receipt, found by the receipt's
    identity, so nothing a caller writes into one can move the books.
    """

    __slots__ = ("_id", "_owner", "_nbytes", "__weakref__")

    def __init__(self, id: int, owner: str, nbytes: int) -> None:
        self._id = id
        self._owner = owner
        self._nbytes = nbytes

    @property
    def id(self) -> int:
        return self._id

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __repr__(self) -> str:
        return f"Reservation(#{self._id} {self._owner}: {self._nbytes} B)"


@dataclass
class _Record:
    """The ledger's own account of one live reservation (the receipt only mirrors it)."""

    id: int
    owner: str
    nbytes: int


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of the device: totals and what processes other than this one hold."""

    total_bytes: int
    used_bytes: int
    free_bytes: int
    external_bytes: int


class MemoryProbe(Protocol):
    """Reads the device's memory (NVML on a GPU; tests substitute their own)."""

    def read(self) -> DeviceMemory: ...


class NvmlProbe:
    """NVML reading of one GPU; ``external_bytes`` sums the other processes' memory.

    pynvml is imported here, lazily, so CPU machines never need it.
    """

    def __init__(self, device_index: int = 0) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self._pid = os.getpid()

    @staticmethod
    def available() -> bool:
        return nvidia_gpu_count() > 0

    def read(self) -> DeviceMemory:
        nvml = self._nvml
        mem = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        external = 0
        for getter in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                processes = getter(self._handle)
            except nvml.NVMLError:
                continue
            external += sum(int(p.usedGpuMemory or 0) for p in processes if p.pid != self._pid)
        return DeviceMemory(int(mem.total), int(mem.used), int(mem.free), external)


def validate_size(value: object, what: str = "size") -> int:
    """``value`` as a byte count in [0, 2**64); bools, floats, negatives and overflow refused."""
    return check_int(value, what, low=0, high=U64_MAX, noun="an integer byte count", error=LedgerError)


def validate_owner(owner: object) -> str:
    """``owner`` as a non-empty string (it names the holder in snapshots and refusals)."""
    if not isinstance(owner, str) or not owner:
        raise LedgerError(f"a reservation's owner must be a non-empty string, got {shown(owner)}")
    return owner


def _validate_interval(every_s: object) -> float:
    """A reconcile interval: finite, positive seconds (a NaN or infinite wait would kill the timer thread)."""
    return check_real(every_s, "reconcile interval (s)", low=0.0, high=float(10**9), low_open=True,
                      error=LedgerError)


@dataclass(frozen=True)
class LedgerSnapshot:
    """A consistent view: the cap, what is allocated, by whom, and the last device reading."""

    max_bytes: int
    allocated_bytes: int
    reservations: tuple[tuple[int, str, int], ...]
    device: DeviceMemory | None
    reconciliations: int

    @property
    def external_bytes(self) -> int:
        return self.device.external_bytes if self.device else 0

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - self.allocated_bytes - self.external_bytes

    @property
    def by_owner(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, owner, nbytes in self.reservations:
            out[owner] = out.get(owner, 0) + nbytes
        return out

    @property
    def drift_bytes(self) -> int | None:
        """Device bytes in use that neither the ledger nor other processes explain.

        Positive: this process uses more than it reserved (estimates too low, or
        allocations outside the ledger); negative: reservations not (yet) backed.
        ``None`` without a device reading.
        """
        if self.device is None:
            return None
        return self.device.used_bytes - self.device.external_bytes - self.allocated_bytes


class VramLedger:
    """Compare-and-commit admission of owned byte reservations under one lock.

    ``capacity_bytes`` fixes the cap (a CPU machine, or a deliberately smaller budget);
    otherwise the cap is ``admit_percent`` of the total memory that ``probe`` (NVML by
    default) reports. ``reconcile_every_s`` starts a background re-read of the device;
    :meth:`reconcile` does one now.
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        admit_percent: float = DEFAULT_ADMIT_PERCENT,
        probe: MemoryProbe | None = None,
        device_index: int = 0,
        reconcile_every_s: float | None = None,
    ) -> None:
        admit_percent = check_real(admit_percent, "admit_percent", low=0.0, high=100.0, low_open=True,
                                   error=LedgerError)
        if reconcile_every_s is not None:
            _validate_interval(reconcile_every_s)
        if probe is None and capacity_bytes is None:
            if not NvmlProbe.available():
                raise LedgerError("no GPU visible through NVML: give the ledger a capacity_bytes budget")
            probe = NvmlProbe(device_index)
        self._lock = threading.Lock()
        self._probe = probe
        self._device: DeviceMemory | None = None
        self._reconciliations = 0
        self._records: dict[Reservation, _Record] = {}  # keyed by receipt identity (no __eq__/__hash__ override)
        self._allocated = 0
        self._ids = itertools.count(1)
        self._issued: weakref.WeakSet[Reservation] = weakref.WeakSet()  # every receipt issued and still referenced
        self.admit_percent = admit_percent
        if capacity_bytes is not None:
            self._max = validate_size(capacity_bytes, "capacity_bytes")
        else:
            assert probe is not None
            device = probe.read()
            self._device = device
            self._max = int(device.total_bytes * self.admit_percent / 100)
        self._external = self._device.external_bytes if self._device else 0
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if reconcile_every_s is not None:
            self.start_reconciling(reconcile_every_s)

    # -- admission --------------------------------------------------------------------
    @property
    def max_bytes(self) -> int:
        return self._max

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def try_reserve(self, nbytes: int, owner: str) -> Reservation:
        """Reserve ``nbytes`` for ``owner`` or raise :class:`LedgerDenied` (nothing changes)."""
        n = nbytes if type(nbytes) is int and 0 <= nbytes <= U64_MAX else validate_size(nbytes, "request")
        validate_owner(owner)
        with self._lock:
            projected = self._allocated + self._external + n
            if projected > self._max:
                raise LedgerDenied(owner=owner, max_bytes=self._max, allocated_bytes=self._allocated,
                                   request_bytes=n, external_bytes=self._external)
            record = _Record(next(self._ids), owner, n)
            reservation = Reservation(record.id, owner, n)
            self._records[reservation] = record
            self._issued.add(reservation)
            self._allocated += n
            return reservation

    def _record(self, reservation: object) -> _Record:
        """The live record of ``reservation`` (lock held), or a :class:`LedgerError` saying why there is none."""
        if not isinstance(reservation, Reservation):
            raise LedgerError(f"expected a Reservation, got {shown(reservation)}")
        record = self._records.get(reservation)
        if record is not None:
            return record
        if reservation in self._issued:
            raise LedgerError(f"{reservation!r} was already released")
        raise LedgerError(f"{reservation!r} was not issued by this ledger (it belongs to another ledger or was "
                          "built by hand)")

    def release(self, reservation: Reservation) -> int:
        """Give back exactly what the ledger recorded for ``reservation``; returns the bytes released."""
        with self._lock:
            record = self._record(reservation)
            del self._records[reservation]
            self._allocated -= record.nbytes
            return record.nbytes

    def resize(self, reservation: Reservation, nbytes: int) -> None:
        """Correct a live reservation to ``nbytes`` (e.g. what loading really took).

        Shrinking always succeeds; growing is admitted like a new request for the
        difference and raises :class:`LedgerDenied` leaving the reservation unchanged.
        """
        n = validate_size(nbytes, "resize")
        with self._lock:
            record = self._record(reservation)
            grow = n - record.nbytes
            if grow > 0 and self._allocated + self._external + grow > self._max:
                raise LedgerDenied(owner=record.owner, max_bytes=self._max, allocated_bytes=self._allocated,
                                   request_bytes=grow, external_bytes=self._external)
            self._allocated += grow
            record.nbytes = reservation._nbytes = n

    def transfer(self, reservation: Reservation, owner: str) -> None:
        """Hand a live reservation to another owner (bytes unchanged, no window to lose them)."""
        validate_owner(owner)
        with self._lock:
            record = self._record(reservation)
            record.owner = reservation._owner = owner

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` would be admitted now (advice only: use try_reserve to commit)."""
        n = validate_size(nbytes, "request")
        with self._lock:
            return self._allocated + self._external + n <= self._max

    def snapshot(self) -> LedgerSnapshot:
        with self._lock:
            held = tuple((r.id, r.owner, r.nbytes) for r in self._records.values())
            return LedgerSnapshot(self._max, self._allocated, held, self._device, self._reconciliations)

    # -- reconciliation with the device ------------------------------------------------
    def reconcile(self) -> LedgerSnapshot:
        """Re-read the device now: other processes' memory starts counting against admission."""
        if self._probe is not None:
            device = self._probe.read()
            with self._lock:
                self._device = device
                self._external = device.external_bytes
                self._reconciliations += 1
        return self.snapshot()

    def start_reconciling(self, every_s: float, on_error: Callable[[Exception], None] | None = None) -> None:
        """Reconcile every ``every_s`` seconds on a daemon thread until :meth:`close`."""
        every_s = _validate_interval(every_s)
        if self._probe is None or self._timer is not None:
            return

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    self.reconcile()
                except Exception as exc:  # a failed NVML read must not kill admission
                    if on_error is not None:
                        on_error(exc)

        self._timer = threading.Thread(target=loop, name="kvrt-ledger-reconcile", daemon=True)
        self._timer.start()

    def close(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
            self._timer = None

    def __repr__(self) -> str:
        return f"VramLedger(max={self._max} B, allocated={self._allocated} B, {len(self._records)} reservations)"
