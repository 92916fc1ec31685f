"""The VRAM ledger: stateful invariants, validation, threads, reconciliation with the device."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvrt.ledger import DeviceMemory, LedgerDenied, LedgerError, Reservation, VramLedger, validate_size

CAP = 1_000_000


class LedgerMachine(RuleBasedStateMachine):
    """Random reserve/release/resize sequences against a plain model of the books."""

    reservations = Bundle("reservations")
    released = Bundle("released")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = VramLedger(CAP)
        self.live: dict[int, int] = {}

    @rule(target=reservations, nbytes=st.integers(0, CAP // 3), owner=st.sampled_from(["model:a", "agent:x", "pool"]))
    def reserve(self, nbytes: int, owner: str):
        before = self.ledger.snapshot()
        fits = sum(self.live.values()) + nbytes <= CAP
        try:
            reservation = self.ledger.try_reserve(nbytes, owner)
        except LedgerDenied as exc:
            assert not fits
            assert (exc.max_bytes, exc.allocated_bytes, exc.request_bytes) == (CAP, sum(self.live.values()), nbytes)
            assert self.ledger.snapshot() == before  # a refusal changes nothing
            return None
        assert fits
        self.live[reservation.id] = nbytes
        return reservation

    @rule(reservation=consumes(reservations), target=released)
    def release(self, reservation: Reservation | None):
        if reservation is None:
            return None
        assert self.ledger.release(reservation) == self.live.pop(reservation.id)
        return reservation

    @rule(reservation=released)
    def release_again_is_refused(self, reservation: Reservation | None):
        if reservation is None:
            return
        before = self.ledger.snapshot()
        with pytest.raises(LedgerError, match="not held"):
            self.ledger.release(reservation)
        assert self.ledger.snapshot() == before

    @rule(reservation=reservations, nbytes=st.integers(0, CAP // 2))
    def resize(self, reservation: Reservation | None, nbytes: int):
        if reservation is None or reservation.id not in self.live:
            return
        grow = nbytes - self.live[reservation.id]
        fits = sum(self.live.values()) + grow <= CAP
        try:
            self.ledger.resize(reservation, nbytes)
        except LedgerDenied:
            assert grow > 0 and not fits
            return
        assert grow <= 0 or fits
        self.live[reservation.id] = nbytes

    @rule()
    def release_unknown_is_refused(self):
        with pytest.raises(LedgerError):
            self.ledger.release(Reservation(10**9, "stranger", 1))

    @invariant()
    def books_balance(self):
        snap = self.ledger.snapshot()
        assert snap.allocated_bytes == sum(self.live.values()) == sum(n for _, _, n in snap.reservations)
        assert 0 <= snap.allocated_bytes <= snap.max_bytes


TestLedgerMachine = LedgerMachine.TestCase


@pytest.mark.parametrize("bad", [True, False, 1.0, 2.5, -1, 2**64, "10", None, [1]])
def test_invalid_sizes_are_refused_and_change_nothing(bad):
    ledger = VramLedger(CAP)
    held = ledger.try_reserve(10, "x")
    with pytest.raises(LedgerError, match="byte count|outside"):
        ledger.try_reserve(bad, "y")
    snap = ledger.snapshot()
    assert snap.allocated_bytes == 10 and [r[1] for r in snap.reservations] == ["x"]
    ledger.release(held)


def test_numpy_integers_and_the_64_bit_edge():
    assert validate_size(np.int64(7)) == 7
    assert validate_size(2**64 - 1) == 2**64 - 1
    ledger = VramLedger(2**64 - 1)
    big = ledger.try_reserve(2**64 - 2, "big")
    with pytest.raises(LedgerDenied):
        ledger.try_reserve(2, "over")  # would pass 2**64: refused, not wrapped
    ledger.release(big)


def test_deny_reply_is_the_seeds_line():
    ledger = VramLedger(100)
    ledger.try_reserve(60, "model:a")
    with pytest.raises(LedgerDenied) as info:
        ledger.try_reserve(50, "model:b")
    assert info.value.reply() == ("ERR VRAM_LEDGER_DENY code=CAP ledger_max_bytes=100 "
                                  "ledger_allocated_bytes=60 request_table_bytes=50")
    assert "request 50 B" in str(info.value) and "leaves 40 B" in str(info.value)


def test_no_lost_update_under_eight_threads():
    ledger = VramLedger(CAP)
    barrier = threading.Barrier(8)
    held: list[list[Reservation]] = [[] for _ in range(8)]
    denied = [0] * 8

    def work(i: int) -> None:
        barrier.wait()
        for n in range(2000):
            try:
                held[i].append(ledger.try_reserve(97 + i, f"t{i}"))
            except LedgerDenied:
                denied[i] += 1
            if n % 3 == 0 and held[i]:
                ledger.release(held[i].pop())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = ledger.snapshot()
    expected = sum(r.nbytes for rs in held for r in rs)
    assert snap.allocated_bytes == expected <= CAP
    assert len(snap.reservations) == sum(len(rs) for rs in held)
    assert sum(denied) > 0  # the cap was actually contended
    for rs in held:
        for r in rs:
            ledger.release(r)
    assert ledger.allocated_bytes == 0


class FakeProbe:
    def __init__(self, total: int, external: int = 0) -> None:
        self.total, self.external, self.used = total, external, external

    def read(self) -> DeviceMemory:
        return DeviceMemory(self.total, self.used, self.total - self.used, self.external)


def test_capacity_from_the_device_and_other_processes_count_after_reconcile():
    probe = FakeProbe(total=1000)
    ledger = VramLedger(probe=probe, admit_percent=90)
    assert ledger.max_bytes == 900
    mine = ledger.try_reserve(500, "model:a")
    probe.external, probe.used = 300, 300 + 520  # someone else arrived; we use a bit more than reserved
    snap = ledger.reconcile()
    assert snap.external_bytes == 300 and snap.drift_bytes == 20 and snap.reconciliations == 1
    with pytest.raises(LedgerDenied) as info:
        ledger.try_reserve(200, "model:b")  # 500 + 300 + 200 > 900
    assert info.value.reply().endswith("external_bytes=300")
    ledger.try_reserve(100, "model:c")
    ledger.release(mine)


def test_reconcile_timer_runs_and_stops():
    probe = FakeProbe(total=1000)
    ledger = VramLedger(probe=probe, reconcile_every_s=0.01)
    seen = threading.Event()
    original = probe.read

    def read() -> DeviceMemory:
        seen.set()
        return original()

    probe.read = read  # type: ignore[method-assign]
    assert seen.wait(10)
    ledger.close()
    assert ledger.snapshot().reconciliations >= 1


def test_transfer_and_snapshot_by_owner():
    ledger = VramLedger(CAP)
    r = ledger.try_reserve(10, "agent:a")
    ledger.transfer(r, "agent:b")
    assert ledger.snapshot().by_owner == {"agent:b": 10}
    ledger.release(r)
    with pytest.raises(LedgerError):
        ledger.transfer(r, "agent:c")


def test_bad_configuration_is_refused():
    with pytest.raises(LedgerError, match="admit_percent"):
        VramLedger(10, admit_percent=0)
    with pytest.raises(LedgerError, match="capacity_bytes"):
        VramLedger(-5)


@pytest.mark.gpu
def test_nvml_ledger_on_a_real_gpu():
    """The default ledger reads the card: cap = 90% of total, reconciliation fills the drift report."""
    import pynvml

    ledger = VramLedger()
    pynvml.nvmlInit()
    total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
    assert ledger.max_bytes == int(total * 0.9)
    held = ledger.try_reserve(1 << 30, "pool:test")
    snap = ledger.reconcile()
    assert snap.device is not None and snap.device.total_bytes == total and snap.reconciliations == 1
    assert snap.drift_bytes == snap.device.used_bytes - snap.external_bytes - (1 << 30)
    ledger.release(held)
    ledger.close()


def test_no_gpu_needs_a_configured_capacity():
    from kvrt.ledger import NvmlProbe

    if NvmlProbe.available():
        pytest.skip("NVML sees a GPU here")
    with pytest.raises(LedgerError, match="capacity_bytes"):
        VramLedger()
