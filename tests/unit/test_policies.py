"""The restart and placement policies: pure decisions, every branch."""

from __future__ import annotations

import pytest

from policies.placement import place_job
from policies.restart import RestartPolicy, decide_restart

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

POLICY = RestartPolicy(max_restarts=3, window_s=60, base_delay_s=0.5, max_delay_s=4)


def test_first_exit_restarts_after_the_base_delay():
    decision = decide_restart(POLICY, [], now=100)
    assert decision.restart and decision.delay_s == 0.5


def test_backoff_doubles_with_each_recent_restart():
    delays = [decide_restart(POLICY, [100.0] * n, now=101).delay_s for n in range(3)]
    assert delays == [0.5, 1.0, 2.0]


def test_backoff_is_capped():
    policy = RestartPolicy(max_restarts=10, window_s=60, base_delay_s=1, max_delay_s=4)
    assert decide_restart(policy, [100.0] * 6, now=101).delay_s == 4


def test_gives_up_when_the_budget_is_spent_within_the_window():
    decision = decide_restart(POLICY, [10.0, 20.0, 30.0], now=40)
    assert not decision.restart
    assert "4 times within 60s" in decision.reason


def test_old_restarts_leave_the_window():
    decision = decide_restart(POLICY, [10.0, 20.0, 30.0], now=95)
    assert decision.restart and decision.delay_s == 0.5


def test_zero_budget_never_restarts():
    assert not decide_restart(RestartPolicy(max_restarts=0, window_s=60), [], now=1).restart


def test_places_on_the_node_with_most_free_devices():
    assert place_job(2, {"a": [0, 1], "b": [0, 1, 2]}).node == "b"


def test_ties_go_to_the_first_name():
    assert place_job(1, {"b": [0], "a": [3]}).node == "a"


def test_no_node_fits():
    placement = place_job(5, {"a": [0, 1], "b": [0]})
    assert placement.node is None
    assert "needs 5 device slots" in placement.reason and "2" in placement.reason
