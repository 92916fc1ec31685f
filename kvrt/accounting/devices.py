"""One VRAM ledger per device: the mechanism of multi-device admission (which device is :mod:`.placement`'s job).

A device is llama.cpp's GPU index (what ``main_gpu`` and ``tensor_split`` count) with its own
:class:`~kvrt.accounting.ledger.VramLedger`: capacity from NVML for that index on a GPU machine, or a configured
byte capacity (emulated devices on a CPU machine, or a deliberately smaller budget). ``kvrt serve --devices SPEC``
is parsed by :func:`parse_devices`.

Invariants:

* a charge over several devices (:meth:`DeviceLedgers.reserve`) is all or nothing: either every device's share is
  reserved on that device's ledger, or nothing is and :class:`DevicesDenied` names every device's numbers;
* :meth:`DeviceLedgers.release` gives back exactly what each device's ledger recorded for the charge, once;
* each device's ledger keeps its own cap (``allocated + external <= max`` per device); nothing is pooled across
  devices, since a device cannot use another's free bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvrt.accounting.ledger import (
    DEFAULT_ADMIT_PERCENT,
    LedgerDenied,
    LedgerError,
    LedgerSnapshot,
    Reservation,
    VramLedger,
)
from kvrt.errors import KvrtError

SPEC_HELP = ("INDEX[:SIZE],... (e.g. 0:40GiB,1:40GiB; an index without SIZE reads that GPU's memory through NVML) "
             "or COUNTxSIZE (e.g. 2x24GiB: devices 0..COUNT-1, SIZE each); SIZE is bytes with an optional unit "
             "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024); an index is llama.cpp's GPU "
             "index (main_gpu / tensor_split), which is NVML's where CUDA_DEVICE_ORDER=PCI_BUS_ID")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_COUNT = re.compile(r"^\s*(\d+)\s*[xX]\s*(.+)$")
MAX_DEVICES = 16  # llama.cpp's llama_max_devices() in the builds kvrt ships against


class DeviceSpecError(KvrtError):
    """A ``--devices`` specification could not be read."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device to admit against: llama.cpp's GPU ``index`` and its ledger's cap (``None``: NVML's reading)."""

    index: int
    capacity_bytes: int | None


def parse_size(text: str) -> int:
    """``40GiB``, ``1.5GB``, ``123`` as bytes (a fraction of a byte is dropped); anything else is refused."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise DeviceSpecError(f"{text!r} is not a size: expected a number with an optional unit "
                              f"({', '.join(u for u in _UNITS if u)})")
    number = match.group(1)
    whole, _, fraction = number.partition(".")
    scale = _UNITS[unit]
    return int(whole) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)


def parse_devices(text: str) -> tuple[DeviceSpec, ...]:
    """A ``--devices`` specification (:data:`SPEC_HELP`) as device specs, sorted by index.

    Refused, naming the offending part: an empty spec, an index given twice, an index or count outside
    ``[0, MAX_DEVICES)``, a size of 0 bytes, a part that is neither ``INDEX``, ``INDEX:SIZE`` nor ``COUNTxSIZE``.
    """
    if not text or not text.strip():
        raise DeviceSpecError(f"--devices is empty; expected {SPEC_HELP}")
    counted = _COUNT.match(text)
    if counted is not None:
        count = int(counted.group(1))
        if not 1 <= count <= MAX_DEVICES:
            raise DeviceSpecError(f"--devices {text!r}: a count of {count} devices is outside [1, {MAX_DEVICES}]")
        size = _positive_size(counted.group(2), text)
        return tuple(DeviceSpec(i, size) for i in range(count))
    specs: dict[int, DeviceSpec] = {}
    for part in text.split(","):
        index_text, colon, size_text = part.partition(":")
        if not index_text.strip().isdigit():
            raise DeviceSpecError(f"--devices {text!r}: {part!r} is not INDEX or INDEX:SIZE")
        index = int(index_text)
        if index >= MAX_DEVICES:
            raise DeviceSpecError(f"--devices {text!r}: device index {index} is outside [0, {MAX_DEVICES})")
        if index in specs:
            raise DeviceSpecError(f"--devices {text!r}: device {index} is given twice")
        specs[index] = DeviceSpec(index, _positive_size(size_text, text) if colon else None)
    return tuple(specs[i] for i in sorted(specs))


def _positive_size(text: str, spec: str) -> int:
    size = parse_size(text)
    if size <= 0:
        raise DeviceSpecError(f"--devices {spec!r}: a device of {text!r} = 0 bytes can hold nothing")
    return size


def apportion(nbytes: int, weights: Sequence[float]) -> list[int]:
    """``nbytes`` split by ``weights`` (non-negative, not all zero) into integers that sum to ``nbytes`` exactly.

    Largest remainder: each part is its exact share rounded down, and the bytes left over go one each to the
    parts with the largest remainders (lowest position first among equals). A part never exceeds its exact
    share rounded up, so a share of ``free`` bytes computed from ``free`` itself always fits it.
    """
    if nbytes < 0:
        raise LedgerError(f"cannot apportion a negative byte count ({nbytes})")
    if not weights or any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise LedgerError(f"apportioning needs non-negative weights, not all zero; got {list(weights)}")
    exact = [Fraction(w) for w in weights]  # exact for floats too: float shares of 2**60 bytes would lose bytes
    total = sum(exact)
    parts = [nbytes * w // total for w in exact]
    remainders = [nbytes * w / total - p for w, p in zip(exact, parts)]
    left = nbytes - sum(parts)
    for i in sorted(range(len(parts)), key=lambda i: (-remainders[i], i))[:left]:
        parts[i] += 1
    return parts


class DevicesDenied(LedgerDenied):
    """A charge that no device (or set of devices) can take; nothing was changed.

    The message names every device's numbers (cap, allocated, other processes, free). The inherited fields sum the
    devices, so a caller that reports a single ledger's refusal (HTTP 507, the socket's ``ERR CAP``) still works.
    """

    def __init__(self, *, owner: str, request_bytes: int, snapshots: Mapping[int, LedgerSnapshot], why: str) -> None:
        self.devices = dict(snapshots)
        KvrtError.__init__(self, f"no device can take {owner}: {why}; " + describe_devices(snapshots))
        self.owner = owner
        self.request_bytes = request_bytes
        self.max_bytes = sum(s.max_bytes for s in snapshots.values())
        self.allocated_bytes = sum(s.allocated_bytes for s in snapshots.values())
        self.external_bytes = sum(s.external_bytes for s in snapshots.values())


def describe_devices(snapshots: Mapping[int, LedgerSnapshot]) -> str:
    """Every device's numbers in one line: ``device 0: 123 B free of max 456 B (300 B allocated[, 33 B others])``."""
    parts = []
    for index, snap in sorted(snapshots.items()):
        others = f", {snap.external_bytes} B held by other processes" if snap.external_bytes else ""
        parts.append(f"device {index}: {max(snap.free_bytes, 0)} B free of max {snap.max_bytes} B "
                     f"({snap.allocated_bytes} B allocated{others})")
    return "; ".join(parts)


class DeviceCharge(Mapping[int, Reservation]):
    """One owner's reservations, one per device it charged (device index -> receipt); read-only.

    Handed back to :meth:`DeviceLedgers.release` exactly once; ``nbytes`` is what the devices' ledgers hold for it.
    """

    def __init__(self, owner: str, parts: Mapping[int, Reservation]) -> None:
        self.owner = owner
        self._parts = dict(parts)

    def __getitem__(self, index: int) -> Reservation:
        return self._parts[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._parts.values())

    def by_device(self) -> dict[int, int]:
        return {index: r.nbytes for index, r in self._parts.items()}

    def __repr__(self) -> str:
        return f"DeviceCharge({self.owner}: {self.by_device()})"


class DeviceLedgers:
    """The ledgers of a set of devices, by index; charges that span devices are all or nothing."""

    def __init__(self, ledgers: Mapping[int, VramLedger]) -> None:
        if not ledgers:
            raise DeviceSpecError("a device set needs at least one device")
        self._ledgers = dict(sorted(ledgers.items()))

    @classmethod
    def from_specs(cls, specs: Sequence[DeviceSpec], *, admit_percent: float = DEFAULT_ADMIT_PERCENT,
                   reconcile_every_s: float | None = None) -> DeviceLedgers:
        """A ledger per spec: its configured capacity, or ``admit_percent`` of what NVML reads for its index (re-read
        every ``reconcile_every_s``). A spec without a capacity where NVML sees no such GPU is refused."""
        ledgers: dict[int, VramLedger] = {}
        try:
            for spec in specs:
                try:
                    ledgers[spec.index] = VramLedger(
                        spec.capacity_bytes, admit_percent=admit_percent, device_index=spec.index,
                        reconcile_every_s=reconcile_every_s if spec.capacity_bytes is None else None)
                except LedgerError as exc:
                    raise DeviceSpecError(f"device {spec.index}: {exc} (give it a size: {spec.index}:SIZE)") from exc
        except BaseException:
            for ledger in ledgers.values():
                ledger.close()
            raise
        return cls(ledgers)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(self._ledgers)

    def ledger(self, index: int) -> VramLedger:
        """The ledger of device ``index`` (a :class:`DeviceSpecError` names the devices there are)."""
        try:
            return self._ledgers[index]
        except KeyError:
            raise DeviceSpecError(f"no device {index}; this set has devices {list(self._ledgers)}") from None

    def snapshots(self) -> dict[int, LedgerSnapshot]:
        """Every device's :class:`~kvrt.accounting.ledger.LedgerSnapshot`, by index."""
        return {index: ledger.snapshot() for index, ledger in self._ledgers.items()}

    def free_bytes(self) -> dict[int, int]:
        """What each device would admit now (cap less allocated less other processes'), never below 0."""
        return {index: max(snap.free_bytes, 0) for index, snap in self.snapshots().items()}

    def reserve(self, amounts: Mapping[int, int], owner: str) -> DeviceCharge:
        """Reserve ``amounts[d]`` bytes on each device ``d`` for ``owner``, all or nothing.

        A device's refusal gives back the parts already taken and raises :class:`DevicesDenied` naming every
        device's numbers; an unknown device raises :class:`DeviceSpecError` before anything is taken.
        """
        ledgers = {index: self.ledger(index) for index in amounts}
        taken: dict[int, Reservation] = {}
        try:
            for index, nbytes in sorted(amounts.items()):
                taken[index] = ledgers[index].try_reserve(nbytes, owner)
        except LedgerDenied as denied:
            for index, reservation in taken.items():
                ledgers[index].release(reservation)
            raise DevicesDenied(owner=owner, request_bytes=sum(amounts.values()), snapshots=self.snapshots(),
                                why=f"device {_first_untaken(amounts, taken)} refused its share "
                                    f"{denied.request_bytes} B of {dict(sorted(amounts.items()))}") from denied
        except BaseException:
            for index, reservation in taken.items():
                ledgers[index].release(reservation)
            raise
        return DeviceCharge(owner, taken)

    def release(self, charge: DeviceCharge) -> dict[int, int]:
        """Give back every part of ``charge``; returns the bytes each device's ledger released."""
        if not isinstance(charge, DeviceCharge):
            raise LedgerError(f"expected a DeviceCharge, got {type(charge).__name__}")
        return {index: self.ledger(index).release(reservation) for index, reservation in charge.items()}

    def state(self) -> dict[str, dict[str, Any]]:
        """Each device's ledger as ``/v1/kvrt/stats`` shows it, keyed by the device index as text."""
        return {str(index): {"capacity_bytes": snap.max_bytes, "allocated_bytes": snap.allocated_bytes,
                             "external_bytes": snap.external_bytes, "free_bytes": snap.free_bytes,
                             "by_owner": snap.by_owner}
                for index, snap in self.snapshots().items()}

    def close(self) -> None:
        for ledger in self._ledgers.values():
            ledger.close()

    def __repr__(self) -> str:
        return f"DeviceLedgers({', '.join(f'{i}: {ledger!r}' for i, ledger in self._ledgers.items())})"


def _first_untaken(amounts: Mapping[int, int], taken: Mapping[int, Reservation]) -> int:
    """The device whose ledger refused: the first in index order not taken (parts are taken in that order)."""
    return next(index for index in sorted(amounts) if index not in taken)
