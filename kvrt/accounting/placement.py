"""Where a model and an agent's request go among several devices: the policy (the ledgers are :mod:`.devices`).

Kept apart from the mechanism, as vLLM keeps its block pool apart from the cache manager's choices: a
:class:`DeviceLedgers` only reserves and releases; :class:`FreeMemoryPolicy` only decides, from numbers it is given,
and changes nothing. Whoever loads (the HTTP front's model pool, the registry the socket front shares) asks the policy,
then reserves what it chose on the ledgers, so a choice that went stale meanwhile is refused by the ledger, never
over-committed.

* **a model**: the device with the most memory free after the model's weights and its context estimate
  (:mod:`kvrt.accounting.estimate`) wins (lowest index among equals); a model larger than any one device's free
  memory but not than all of them together gets a *split plan*: llama.cpp's ``split_mode=layer`` over every device
  with free memory, ``tensor_split`` proportional to each one's free memory, each device charged the same share of
  the bytes (:func:`kvrt.accounting.devices.apportion`: the shares sum to the need exactly and none exceeds its
  device's free bytes). Nothing fits even split: :class:`~kvrt.accounting.devices.DevicesDenied` naming every
  device's numbers.
* **an agent's request** (a model loaded on several devices): the device whose engine holds the longest prefix of
  the request's tokens (the agent's cached history) wins; with no cached prefix anywhere, the least loaded one
  (fewest queued and running requests, then most free memory, then lowest index).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvrt.accounting.devices import DevicesDenied, apportion
from kvrt.accounting.ledger import LedgerSnapshot
from kvrt.errors import InvalidArgument

NO_SPLIT, LAYER_SPLIT = "none", "layer"


@dataclass(frozen=True)
class Placement:
    """Devices that hold one model, main device first, and each one's share of it (proportions: any positive
    numbers; a split plan gives each device's free bytes, so the shares of a charge are exact integers).

    One device: llama.cpp's ``split_mode=none`` with ``main_gpu`` that device. Several: ``split_mode=layer``, whole
    layers placed by ``tensor_split`` (one proportion per llama.cpp GPU index, 0 for devices left out) and
    ``main_gpu`` the device with the largest share (where llama.cpp keeps the results and small tensors).
    """

    devices: tuple[int, ...]
    shares: tuple[int | float, ...]

    def __post_init__(self) -> None:
        if not self.devices or len(self.devices) != len(self.shares) or len(set(self.devices)) != len(self.devices):
            raise InvalidArgument(f"a placement needs distinct devices with one share each, got {self.devices} "
                             f"and {self.shares}")
        if any(not s > 0 for s in self.shares):
            raise InvalidArgument(f"every device of a placement needs a positive share, got {self.shares}")

    @classmethod
    def on(cls, device: int) -> Placement:
        """All of the model on ``device``."""
        return cls((device,), (1.0,))

    @property
    def main(self) -> int:
        return self.devices[0]

    @property
    def split(self) -> bool:
        return len(self.devices) > 1

    @property
    def fractions(self) -> tuple[float, ...]:
        """Each device's share as a fraction of the whole (they sum to 1)."""
        total = sum(self.shares)
        return tuple(s / total for s in self.shares)

    def charges(self, nbytes: int) -> dict[int, int]:
        """``nbytes`` (weights or a context: KV sits with its layers) apportioned to the devices by their shares."""
        return dict(zip(self.devices, apportion(nbytes, self.shares)))

    def model_params(self) -> dict[str, Any]:
        """The :class:`kvrt.engine.model.ModelParams` fields that put a model here (``main_gpu``, ``split_mode``,
        ``tensor_split``); a CPU build of llama.cpp accepts them and places nothing."""
        if not self.split:
            return {"main_gpu": self.main, "split_mode": NO_SPLIT, "tensor_split": None}
        proportions = [0.0] * (max(self.devices) + 1)
        for device, fraction in zip(self.devices, self.fractions):
            proportions[device] = fraction
        return {"main_gpu": self.main, "split_mode": LAYER_SPLIT, "tensor_split": tuple(proportions)}

    def describe(self) -> str:
        if not self.split:
            return f"device {self.main}"
        return "split over " + ", ".join(f"device {d} ({f:.0%})" for d, f in zip(self.devices, self.fractions))


@dataclass(frozen=True)
class Candidate:
    """One device a request could go to: its engine's longest cached prefix of the request's tokens (0: none),
    its queued plus running requests, and its free memory."""

    device: int
    cached_tokens: int
    load: int
    free_bytes: int


class PlacementPolicy(Protocol):
    """What a front asks: where a model goes, and which of a model's devices serves a request."""

    def place(self, need_bytes: int, free_bytes: Mapping[int, int], *, owner: str,
              snapshots: Mapping[int, LedgerSnapshot]) -> Placement: ...

    def route(self, candidates: Sequence[Candidate]) -> int: ...


class FreeMemoryPolicy:
    """kvrt's placement: by free memory, split when one device is not enough; requests by prefix affinity."""

    def place(self, need_bytes: int, free_bytes: Mapping[int, int], *, owner: str,
              snapshots: Mapping[int, LedgerSnapshot]) -> Placement:
        """Where ``need_bytes`` (weights + context) goes given each device's ``free_bytes``; see the module
        docstring. ``snapshots`` (each device's ledger snapshot) only feed the refusal's message."""
        if not free_bytes:
            raise InvalidArgument("placing a model needs at least one device")
        fitting = [(free - need_bytes, -device) for device, free in free_bytes.items() if free >= need_bytes]
        if fitting:
            return Placement.on(-max(fitting)[1])
        usable = {device: free for device, free in sorted(free_bytes.items()) if free > 0}
        total = sum(usable.values())
        if total < need_bytes or len(usable) < 2:
            raise DevicesDenied(owner=owner, request_bytes=need_bytes, snapshots=snapshots,
                                why=f"it needs {need_bytes} B, more than any one device has free and more than "
                                    f"all {len(free_bytes)} together ({total} B)")
        order = sorted(usable, key=lambda d: (-usable[d], d))  # the largest share first: llama.cpp's main_gpu
        return Placement(tuple(order), tuple(usable[d] for d in order))

    def route(self, candidates: Sequence[Candidate]) -> int:
        """The device of the longest cached prefix; none cached anywhere: the least loaded, then the most free."""
        if not candidates:
            raise InvalidArgument("routing a request needs at least one candidate device")
        best = max(candidates, key=lambda c: (c.cached_tokens, -c.load, c.free_bytes, -c.device))
        return best.device
