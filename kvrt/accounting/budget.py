"""The memory budget a daemon admits against: a fixed cap, the GPU's memory, or a stated share of host RAM.

A GPU machine admits against ``admit_percent`` of the GPU's memory as NVML reports it (and
keeps re-reading it). A machine without one serves models from host RAM, so the default
there is a stated share of the RAM this machine has (``HOST_RAM_SHARE_PERCENT``), shown
by STATUS, instead of refusing to start.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kvrt.errors import KvrtError
from kvrt.system.gpu import nvidia_gpu_count

HOST_RAM_SHARE_PERCENT = 50.0


@dataclass(frozen=True)
class Budget:
    """Where the ledger's cap comes from: ``fixed`` bytes, ``nvml`` (the GPU), ``host_ram``, or ``devices`` (one ledger
    per ``kvrt serve --devices`` device: :mod:`kvrt.accounting.devices`)."""

    source: str
    capacity_bytes: int | None  # None: the ledger reads the GPU through NVML
    share_percent: float
    reason: str


def host_ram_bytes() -> int:
    """Physical RAM of this machine (``sysconf``), in bytes."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError) as exc:
        raise KvrtError(f"cannot read this machine's RAM size ({exc}); give --capacity-bytes") from exc


def choose_budget(
    capacity_bytes: int | None,
    admit_percent: float,
    *,
    gpu_count: Callable[[], int] = nvidia_gpu_count,
    ram_bytes: Callable[[], int] = host_ram_bytes,
) -> Budget:
    """The fixed cap when one is given, else the GPU's memory when NVML sees a GPU, else a share of host RAM."""
    if capacity_bytes is not None:
        return Budget("fixed", capacity_bytes, 100.0, "--capacity-bytes given")
    gpus = gpu_count()
    if gpus:
        return Budget("nvml", None, admit_percent, f"{gpus} NVIDIA GPU(s) visible through NVML")
    ram = ram_bytes()
    return Budget("host_ram", int(ram * HOST_RAM_SHARE_PERCENT / 100), HOST_RAM_SHARE_PERCENT,
                  f"no NVIDIA GPU visible: {HOST_RAM_SHARE_PERCENT:g} % of this machine's {ram} B of RAM")
