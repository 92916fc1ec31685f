"""The VRAM ledger: stateful invariants, validation, threads, reconciliation with the device."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvrt.accounting.ledger import DeviceMemory, LedgerDenied, LedgerError, Reservation, VramLedger, validate_size
from kvrt.serve.protocol import error_reply

CAP = 1_000_000


OWNERS = st.sampled_from(["model:a", "agent:x", "pool"])
JUNK = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=5), st.integers(-(2**70), 2**70),
                 st.binary(max_size=5), st.lists(st.integers(), max_size=2))


class LedgerMachine(RuleBasedStateMachine):
    """Random reserve/resize/transfer/release sequences, hostile receipts included, against a plain model.

    Invariants: allocated == the sum of the live reservations' recorded sizes (the
    model's and the snapshot's), within [0, cap]; every refusal leaves the snapshot as
    it was.
    """

    reservations = Bundle("reservations")
    released = Bundle("released")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = VramLedger(CAP)
        self.other = VramLedger(CAP)
        self.live: dict[Reservation, tuple[str, int]] = {}  # keyed by identity, like the ledger

    def refused(self, call, error=LedgerError, match: str | None = None):
        """Run ``call``, expecting ``error``; the books must not move."""
        before = self.ledger.snapshot()
        with pytest.raises(error, match=match):
            call()
        assert self.ledger.snapshot() == before

    @rule(target=reservations, nbytes=st.integers(0, CAP // 3), owner=OWNERS)
    def reserve(self, nbytes: int, owner: str):
        fits = self.allocated + nbytes <= CAP
        if not fits:
            self.refused(lambda: self.ledger.try_reserve(nbytes, owner), LedgerDenied)
            return None
        reservation = self.ledger.try_reserve(nbytes, owner)
        assert (reservation.owner, reservation.nbytes) == (owner, nbytes)
        self.live[reservation] = (owner, nbytes)
        return reservation

    @rule(reservation=consumes(reservations), target=released)
    def release(self, reservation: Reservation | None):
        if reservation is None:
            return None
        assert self.ledger.release(reservation) == self.live.pop(reservation)[1]
        return reservation

    @rule(reservation=released)
    def release_again_is_refused(self, reservation: Reservation | None):
        if reservation is not None:
            self.refused(lambda: self.ledger.release(reservation), match="already released")

    @rule(reservation=reservations, nbytes=st.integers(0, CAP // 2))
    def resize(self, reservation: Reservation | None, nbytes: int):
        if reservation is None:
            return
        owner, held = self.live[reservation]
        if self.allocated + nbytes - held > CAP:
            self.refused(lambda: self.ledger.resize(reservation, nbytes), LedgerDenied)
            return
        self.ledger.resize(reservation, nbytes)
        self.live[reservation] = (owner, nbytes)

    @rule(reservation=reservations, owner=OWNERS)
    def transfer(self, reservation: Reservation | None, owner: str):
        if reservation is None:
            return
        self.ledger.transfer(reservation, owner)
        self.live[reservation] = (owner, self.live[reservation][1])

    @rule(reservation=reservations, name=st.sampled_from(["nbytes", "owner", "id"]), value=JUNK)
    def assigning_a_field_is_refused(self, reservation: Reservation | None, name: str, value: object):
        if reservation is not None:
            self.refused(lambda: setattr(reservation, name, value), AttributeError)

    @rule(reservation=reservations, slot=st.sampled_from([s for s in Reservation.__slots__ if not s.startswith("__")]),
          value=JUNK)
    def writing_a_private_field_moves_nothing(self, reservation: Reservation | None, slot: str, value: object):
        if reservation is None:
            return
        before = self.ledger.snapshot()
        object.__setattr__(reservation, slot, value)
        assert self.ledger.snapshot() == before

    @rule(nbytes=JUNK, owner=st.one_of(OWNERS, JUNK))
    def invalid_requests_are_refused(self, nbytes: object, owner: object):
        if type(nbytes) is int and 0 <= nbytes <= 2**64 - 1 and isinstance(owner, str) and owner:
            return
        self.refused(lambda: self.ledger.try_reserve(nbytes, owner))  # type: ignore[arg-type]

    @rule(reservation=reservations, value=JUNK)
    def invalid_resizes_and_transfers_are_refused(self, reservation: Reservation | None, value: object):
        if reservation is None:
            return
        if not (type(value) is int and 0 <= value <= 2**64 - 1):
            self.refused(lambda: self.ledger.resize(reservation, value))  # type: ignore[arg-type]
        if not (isinstance(value, str) and value):
            self.refused(lambda: self.ledger.transfer(reservation, value))  # type: ignore[arg-type]

    @rule(nbytes=st.integers(0, 10))
    def foreign_and_forged_receipts_are_refused(self, nbytes: int):
        foreign = self.other.try_reserve(nbytes, "stranger")
        forged = Reservation(foreign.id, "stranger", nbytes)
        receipts = ((foreign, "another ledger"), (forged, "built by hand"), (nbytes, "expected a Reservation"))
        for receipt, why in receipts:  # refused() calls each lambda at once, in this iteration
            self.refused(lambda r=receipt: self.ledger.release(r), match=why)  # type: ignore[arg-type]
            self.refused(lambda r=receipt: self.ledger.resize(r, 0), match=why)  # type: ignore[arg-type]
            self.refused(lambda r=receipt: self.ledger.transfer(r, "x"), match=why)  # type: ignore[arg-type]
        self.other.release(foreign)

    @property
    def allocated(self) -> int:
        return sum(n for _, n in self.live.values())

    @invariant()
    def books_balance(self):
        snap = self.ledger.snapshot()
        assert snap.allocated_bytes == self.allocated == sum(n for _, _, n in snap.reservations)
        assert sorted((o, n) for _, o, n in snap.reservations) == sorted(self.live.values())
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
    assert error_reply(info.value) == ("ERR VRAM_LEDGER_DENY code=CAP ledger_max_bytes=100 "
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
    assert error_reply(info.value).endswith("external_bytes=300")
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
    from kvrt.accounting.ledger import NvmlProbe

    if NvmlProbe.available():
        pytest.skip("NVML sees a GPU here")
    with pytest.raises(LedgerError, match="capacity_bytes"):
        VramLedger()


# -- reservations are the ledger's record, not the caller's ---------------------------------
def test_a_reservation_cannot_be_resized_or_reassigned_by_its_holder():
    ledger = VramLedger(1000)
    held = ledger.try_reserve(100, "agent:a")
    for name, value in (("nbytes", 10**6), ("owner", "agent:b"), ("id", 99)):
        with pytest.raises(AttributeError):
            setattr(held, name, value)
    assert (held.nbytes, held.owner) == (100, "agent:a")
    assert ledger.release(held) == 100
    assert ledger.allocated_bytes == 0
    with pytest.raises(LedgerDenied):
        ledger.try_reserve(900_000, "agent:c")  # the cap still holds


def test_the_ledger_uses_only_its_own_record_of_a_reservation():
    """Even a caller that writes the private fields cannot move the books."""
    ledger = VramLedger(1000)
    held = ledger.try_reserve(100, "agent:a")
    for slot in Reservation.__slots__:
        if not slot.startswith("__"):
            object.__setattr__(held, slot, 10**6 if slot.endswith("nbytes") else getattr(held, slot))
    ledger.resize(held, 150)
    assert ledger.release(held) == 150 and ledger.allocated_bytes == 0


def test_resize_and_transfer_show_through_the_reading_api():
    ledger = VramLedger(1000)
    held = ledger.try_reserve(100, "agent:a")
    ledger.resize(held, 300)
    ledger.transfer(held, "agent:b")
    assert (held.nbytes, held.owner) == (300, "agent:b")
    assert ledger.snapshot().reservations == ((held.id, "agent:b", 300),)


def test_a_reservation_of_another_ledger_or_released_twice_is_refused_clearly():
    mine, theirs = VramLedger(1000), VramLedger(1000)
    foreign = theirs.try_reserve(10, "agent:x")
    held = mine.try_reserve(10, "agent:y")  # the same id as ``foreign`` in a fresh ledger
    assert held.id == foreign.id
    for call in (mine.release, lambda r: mine.resize(r, 5), lambda r: mine.transfer(r, "z")):
        with pytest.raises(LedgerError, match="belongs to another ledger"):
            call(foreign)
    mine.release(held)
    with pytest.raises(LedgerError, match="already released"):
        mine.release(held)
    with pytest.raises(LedgerError, match="expected a Reservation, got int"):
        mine.release(3)  # type: ignore[arg-type]
    assert (mine.allocated_bytes, theirs.allocated_bytes) == (0, 10)


@pytest.mark.parametrize("owner", ["", None, 7, b"agent"])
def test_an_owner_must_be_a_non_empty_string(owner):
    ledger = VramLedger(1000)
    with pytest.raises(LedgerError, match="owner"):
        ledger.try_reserve(1, owner)  # type: ignore[arg-type]
    held = ledger.try_reserve(1, "agent:a")
    with pytest.raises(LedgerError, match="owner"):
        ledger.transfer(held, owner)  # type: ignore[arg-type]
    assert ledger.snapshot().reservations == ((held.id, "agent:a", 1),)


@pytest.mark.parametrize("kwargs", [{"admit_percent": "90"}, {"admit_percent": float("nan")},
                                    {"reconcile_every_s": "1"}, {"reconcile_every_s": float("nan")},
                                    {"reconcile_every_s": float("inf")}, {"reconcile_every_s": True}])
def test_bad_ledger_settings_are_ledger_errors(kwargs):
    with pytest.raises(LedgerError):
        VramLedger(probe=FakeProbe(1000), **kwargs)
