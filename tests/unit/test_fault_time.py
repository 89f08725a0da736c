"""The time lost to faults a running job exports (``policies.fault_time``), from its own record."""

from __future__ import annotations

import pytest

from policies.fault_time import time_lost_to_faults

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

EVERY_10_S = [0.0, 10.0, 20.0, 30.0]


def test_no_fault_costs_nothing():
    assert time_lost_to_faults(EVERY_10_S, [], now=35.0) == 0.0


def test_an_outage_counts_while_it_lasts_then_as_what_it_cost():
    # A node died at 32 s: 13 s past the usual 10 s by 55 s, with no rollout trained since 30 s.
    assert time_lost_to_faults(EVERY_10_S, [32.0], now=55.0) == pytest.approx(15.0)
    # Training resumed at 58 s: that interval cost 18 s; the one open since is clean.
    assert time_lost_to_faults([*EVERY_10_S, 58.0], [32.0], now=60.0) == pytest.approx(18.0)


def test_a_fault_that_cost_nothing_counts_nothing():
    assert time_lost_to_faults(EVERY_10_S, [15.0], now=35.0) == 0.0


def test_start_up_and_a_job_without_a_usual_interval_are_not_counted():
    assert time_lost_to_faults(EVERY_10_S, [-5.0], now=35.0) == 0.0  # before the first trained rollout
    assert time_lost_to_faults([0.0, 40.0], [20.0], now=45.0) == 0.0  # nothing to compare with yet
