"""One ledger per device (``kvrt.accounting.devices``) and the placement policy (``kvrt.accounting.placement``), on
emulated devices (configured capacities): the ``--devices`` grammar, exact apportioning, all-or-nothing charges over
several devices, placement by free memory, split plans, refusals naming every device, prefix-affinity routing, and
hypothesis properties of the ledger set's invariants."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrt.accounting.devices import (
    MAX_DEVICES,
    DeviceCharge,
    DeviceLedgers,
    DevicesDenied,
    DeviceSpec,
    DeviceSpecError,
    apportion,
    parse_devices,
    parse_size,
)
from kvrt.accounting.ledger import LedgerDenied, LedgerError, VramLedger
from kvrt.accounting.placement import Candidate, FreeMemoryPolicy, Placement

GiB = 1 << 30


def ledgers(*capacities: int) -> DeviceLedgers:
    return DeviceLedgers({i: VramLedger(c) for i, c in enumerate(capacities)})


# -- the --devices grammar ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("0:40GiB,1:40GiB", (DeviceSpec(0, 40 * GiB), DeviceSpec(1, 40 * GiB))),
    ("1:1000,0:2KiB", (DeviceSpec(0, 2048), DeviceSpec(1, 1000))),
    ("2x24GiB", (DeviceSpec(0, 24 * GiB), DeviceSpec(1, 24 * GiB))),
    ("3X1.5GB", tuple(DeviceSpec(i, 1_500_000_000) for i in range(3))),
    ("0,1", (DeviceSpec(0, None), DeviceSpec(1, None))),
    ("0:512MiB, 3", (DeviceSpec(0, 512 << 20), DeviceSpec(3, None))),
])
def test_device_specs_parse(text, expected):
    assert parse_devices(text) == expected


@pytest.mark.parametrize(("text", "names"), [
    ("", "empty"), ("0:1GiB,0:2GiB", "device 0 is given twice"), ("a:1GiB", "'a:1GiB' is not INDEX"),
    ("0:1GiBs", "'1GiBs' is not a size"), ("0:0", "= 0 bytes"), (f"{MAX_DEVICES}:1GiB", f"device index {MAX_DEVICES}"),
    ("0x1GiB", "count of 0"), ("-1:1GiB", "'-1:1GiB' is not INDEX"), ("0:-5", "'-5' is not a size"),
])
def test_bad_device_specs_are_refused_naming_the_part(text, names):
    with pytest.raises(DeviceSpecError, match=re.escape(names)):
        parse_devices(text)


def test_sizes():
    assert parse_size("123") == 123 and parse_size("1KB") == 1000 and parse_size("1kib") == 1024
    assert parse_size("0.5GiB") == GiB // 2 and parse_size("2 TB") == 2 * 10**12


def test_a_device_without_a_size_needs_nvml(monkeypatch):
    monkeypatch.setattr("kvrt.accounting.ledger.nvidia_gpu_count", lambda: 0)
    with pytest.raises(DeviceSpecError, match=r"device 1: .*no GPU visible.*give it a size: 1:SIZE"):
        DeviceLedgers.from_specs(parse_devices("0:1GiB,1"))


# -- apportioning -----------------------------------------------------------------------------------------------------
@given(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**40), min_size=1, max_size=8).filter(any))
def test_apportion_sums_exactly_and_never_exceeds_a_share_rounded_up(nbytes, weights):
    parts = apportion(nbytes, weights)
    assert sum(parts) == nbytes and all(p >= 0 for p in parts)
    total = sum(weights)
    for part, weight in zip(parts, weights):
        exact = Fraction(nbytes * weight, total)
        assert exact - 1 < part <= -(-exact.numerator // exact.denominator)


def test_apportion_refuses_weights_that_say_nothing():
    for weights in ([], [0, 0], [1, -1]):
        with pytest.raises(LedgerError, match="weights"):
            apportion(10, weights)


# -- charges over several devices --------------------------------------------------------------------------------------
def test_a_charge_over_devices_is_all_or_nothing_and_names_every_device():
    devices = ledgers(1000, 500, 800)
    devices.ledger(2).try_reserve(700, "other")
    with pytest.raises(DevicesDenied) as refused:
        devices.reserve({0: 400, 1: 400, 2: 200}, "model:big")
    message = str(refused.value)
    assert "device 2 refused its share 200 B" in message
    for numbers in ("device 0: 1000 B free of max 1000 B (0 B allocated)",
                    "device 1: 500 B free of max 500 B (0 B allocated)",
                    "device 2: 100 B free of max 800 B (700 B allocated)"):
        assert numbers in message
    assert isinstance(refused.value, LedgerDenied) and refused.value.request_bytes == 1000
    assert [devices.ledger(i).allocated_bytes for i in range(3)] == [0, 0, 700]  # the parts taken were given back


def test_release_gives_back_exactly_what_each_device_charged_once():
    devices = ledgers(1000, 1000)
    charge = devices.reserve({0: 300, 1: 200}, "ctx")
    assert charge.by_device() == {0: 300, 1: 200} and charge.nbytes == 500
    assert devices.release(charge) == {0: 300, 1: 200}
    assert devices.free_bytes() == {0: 1000, 1: 1000}
    with pytest.raises(LedgerError, match="already released"):
        devices.release(charge)


def test_an_unknown_device_is_refused_before_anything_is_taken():
    devices = ledgers(1000)
    with pytest.raises(DeviceSpecError, match=r"no device 3; this set has devices \[0\]"):
        devices.reserve({0: 10, 3: 10}, "x")
    assert devices.ledger(0).allocated_bytes == 0


def test_state_shows_each_device():
    devices = ledgers(1000, 2000)
    devices.reserve({1: 500}, "model:a")
    assert devices.state()["1"] == {"capacity_bytes": 2000, "allocated_bytes": 500, "external_bytes": 0,
                                    "free_bytes": 1500, "by_owner": {"model:a": 500}}
    assert devices.state()["0"]["allocated_bytes"] == 0


class DeviceSetMachine(RuleBasedStateMachine):
    """Random charges and releases over three devices: each device's reservations never exceed its capacity, a
    refusal changes nothing, a release returns exactly what was charged, and everything released leaves 0."""

    CAPS = (1000, 700, 1500)

    def __init__(self) -> None:
        super().__init__()
        self.devices = ledgers(*self.CAPS)
        self.held: list[tuple[DeviceCharge, dict[int, int]]] = []

    def expected(self) -> dict[int, int]:
        out = dict.fromkeys(range(len(self.CAPS)), 0)
        for _, amounts in self.held:
            for device, nbytes in amounts.items():
                out[device] += nbytes
        return out

    @rule(amounts=st.dictionaries(st.integers(0, 2), st.integers(0, 1200), min_size=1, max_size=3))
    def charge(self, amounts):
        before = self.expected()
        fits = all(before[d] + n <= self.CAPS[d] for d, n in amounts.items())
        try:
            charge = self.devices.reserve(amounts, "owner")
        except DevicesDenied:
            assert not fits
            return
        assert fits and charge.by_device() == amounts
        self.held.append((charge, dict(amounts)))

    @rule(need=st.integers(1, 4000))
    def place_and_charge(self, need):
        policy = FreeMemoryPolicy()
        try:
            placement = policy.place(need, self.devices.free_bytes(), owner="m", snapshots=self.devices.snapshots())
        except DevicesDenied:
            assert need > sum(self.devices.free_bytes().values()) or max(self.devices.free_bytes().values()) < need
            return
        amounts = placement.charges(need)
        assert sum(amounts.values()) == need
        self.held.append((self.devices.reserve(amounts, "m"), amounts))  # the policy's plan always fits

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 10**6))
    def release(self, pick):
        charge, amounts = self.held.pop(pick % len(self.held))
        assert self.devices.release(charge) == amounts

    @invariant()
    def books_match(self):
        expected = self.expected()
        for device, cap in enumerate(self.CAPS):
            ledger = self.devices.ledger(device)
            assert ledger.allocated_bytes == expected[device] <= cap

    def teardown(self):
        for charge, _ in self.held:
            self.devices.release(charge)
        assert all(self.devices.ledger(d).allocated_bytes == 0 for d in range(len(self.CAPS)))


TestDeviceSet = DeviceSetMachine.TestCase
TestDeviceSet.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# -- placement ------------------------------------------------------------------------------------------------------
def place(need: int, free: dict[int, int]) -> Placement:
    devices = DeviceLedgers({d: VramLedger(f) for d, f in free.items()})
    return FreeMemoryPolicy().place(need, devices.free_bytes(), owner="model:m", snapshots=devices.snapshots())


def test_a_model_goes_where_the_most_memory_is_left_after_it():
    assert place(300, {0: 500, 1: 900, 2: 400}) == Placement.on(1)
    assert place(300, {0: 900, 1: 900}) == Placement.on(0)  # equals: the lowest index
    assert place(450, {0: 400, 1: 450}) == Placement.on(1)  # only one fits


def test_a_model_larger_than_any_device_gets_a_split_plan_by_free_memory():
    plan = place(1000, {0: 600, 1: 200, 2: 900})
    assert plan.split and plan.devices == (2, 0, 1)  # largest share first: llama.cpp's main_gpu
    charges = plan.charges(1000)
    assert sum(charges.values()) == 1000 and charges == {2: 529, 0: 353, 1: 118}  # 529.4, 352.9, 117.6
    assert all(charges[d] <= free for d, free in {0: 600, 1: 200, 2: 900}.items())
    params = plan.model_params()
    assert params["split_mode"] == "layer" and params["main_gpu"] == 2
    assert params["tensor_split"] == pytest.approx((600 / 1700, 200 / 1700, 900 / 1700))


def test_a_split_plan_uses_all_free_memory_exactly():
    plan = place(1700, {0: 600, 1: 200, 2: 900})
    assert plan.charges(1700) == {0: 600, 1: 200, 2: 900}


def test_nothing_fits_names_every_device():
    with pytest.raises(DevicesDenied) as refused:
        place(2000, {0: 600, 1: 900})
    message = str(refused.value)
    assert "no device can take model:m: it needs 2000 B" in message and "all 2 together (1500 B)" in message
    assert "device 0: 600 B free of max 600 B" in message and "device 1: 900 B free of max 900 B" in message


def test_one_device_is_never_split():
    with pytest.raises(DevicesDenied, match="more than any one device"):
        place(700, {0: 600})


def test_a_single_device_placement_sets_main_gpu_and_no_split():
    assert Placement.on(3).model_params() == {"main_gpu": 3, "split_mode": "none", "tensor_split": None}


@given(st.integers(1, 10**12), st.dictionaries(st.integers(0, 7), st.integers(0, 10**12), min_size=1, max_size=8))
def test_a_placement_never_charges_a_device_more_than_it_has_free(need, free):
    try:
        plan = FreeMemoryPolicy().place(need, free, owner="m", snapshots={})
    except DevicesDenied:
        assert max(free.values()) < need and (sum(free.values()) < need or sum(f > 0 for f in free.values()) < 2)
        return
    charges = plan.charges(need)
    assert sum(charges.values()) == need
    assert all(charges[d] <= free[d] for d in charges)


# -- routing -----------------------------------------------------------------------------------------------------------
def test_the_longest_cached_prefix_wins_whatever_the_load():
    policy = FreeMemoryPolicy()
    assert policy.route([Candidate(0, 10, 0, 10**9), Candidate(1, 50, 7, 0)]) == 1


def test_without_a_cached_prefix_the_least_loaded_then_the_most_free_wins():
    policy = FreeMemoryPolicy()
    assert policy.route([Candidate(0, 0, 3, 900), Candidate(1, 0, 1, 100)]) == 1
    assert policy.route([Candidate(0, 0, 1, 100), Candidate(1, 0, 1, 900)]) == 1
    assert policy.route([Candidate(0, 0, 1, 100), Candidate(1, 0, 1, 100)]) == 0
