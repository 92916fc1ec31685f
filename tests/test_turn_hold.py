"""The hold of a finished turn's slot (kvrt.runtime.turn_hold): the configured floor, or the measured turnarounds."""

from __future__ import annotations

import pytest

from kvrt.runtime.turn_hold import CAP_S, MARGIN, TurnHold


def test_with_no_turnaround_seen_the_configured_hold_stands():
    assert TurnHold(0.1, 8).seconds == 0.1


def test_a_turnaround_longer_than_the_hold_allows_raises_it_by_the_margin():
    hold = TurnHold(0.1, 8)
    hold.observe(0.02)  # within what 0.1 s covers: nothing changes
    assert hold.seconds == 0.1
    hold.observe(0.2)
    assert hold.seconds == pytest.approx(MARGIN * 0.2)


def test_the_measured_hold_stops_at_the_cap_and_a_longer_configured_one_is_kept():
    hold = TurnHold(0.1, 8)
    hold.observe(0.9 * CAP_S)  # covered by the cap, not by the margin over it
    assert hold.seconds == CAP_S
    longer = TurnHold(2 * CAP_S, 8)
    longer.observe(0.9 * CAP_S)
    assert longer.seconds == 2 * CAP_S


def test_a_turn_later_than_any_hold_could_cover_is_no_sample():
    """An agent back after a tool call or a person's reply: no hold would have kept its slot, and counting it
    would keep the hold at its cap for the bursts of turns already on their way."""
    hold = TurnHold(0.1, 8)
    hold.observe(0.08)
    for late in (5.0, CAP_S + 1e-3):
        hold.observe(late)
        assert hold.seconds == pytest.approx(MARGIN * 0.08)
    only_late = TurnHold(0.1, 8)
    only_late.observe(5.0)
    assert only_late.seconds == 0.1


def test_only_the_last_window_of_turnarounds_counts():
    hold = TurnHold(0.1, 2)
    for turnaround in (0.3, 0.06, 0.07):  # the slow one leaves the window of two
        hold.observe(turnaround)
    assert hold.seconds == pytest.approx(max(0.1, MARGIN * 0.07))


def test_a_configured_hold_of_zero_stays_off():
    hold = TurnHold(0.0, 8)
    hold.observe(0.3)
    assert hold.seconds == 0.0
