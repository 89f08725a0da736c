"""The restart and placement policies: pure decisions, every branch."""

from __future__ import annotations

import pytest

from policies.placement import Group, GroupKind, place_groups
from policies.restart import RestartPolicy, decide_restart

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

POLICY = RestartPolicy(max_restarts=3, window_s=60, base_delay_s=0.5, max_delay_s=4)


def test_first_exit_restarts_at_once():
    decision = decide_restart(POLICY, [], now=100)
    assert decision.restart and decision.delay_s == 0.0


def test_backoff_doubles_with_each_recent_restart():
    delays = [decide_restart(POLICY, [100.0] * n, now=101).delay_s for n in range(3)]
    assert delays == [0.0, 0.5, 1.0]


def test_backoff_is_capped():
    policy = RestartPolicy(max_restarts=10, window_s=60, base_delay_s=1, max_delay_s=4)
    assert decide_restart(policy, [100.0] * 6, now=101).delay_s == 4


def test_gives_up_when_the_budget_is_spent_within_the_window():
    decision = decide_restart(POLICY, [10.0, 20.0, 30.0], now=40)
    assert not decision.restart
    assert "4 times within 60s" in decision.reason


def test_old_restarts_leave_the_window():
    decision = decide_restart(POLICY, [10.0, 20.0, 30.0], now=95)
    assert decision.restart and decision.delay_s == 0.0


def test_zero_budget_never_restarts():
    assert not decide_restart(RestartPolicy(max_restarts=0, window_s=60), [], now=1).restart


def groups(replicas: int = 0, spares: int = 0, engines: int = 0, tp: int = 1) -> list[Group]:
    made = [Group("services", GroupKind.SERVICES, 0)]
    made += [Group(f"replica-{k}", GroupKind.REPLICA, tp) for k in range(replicas)]
    made += [Group(f"spare-{s}", GroupKind.SPARE, tp) for s in range(spares)]
    return made + [Group(f"engine-{i}", GroupKind.ENGINE, 1) for i in range(engines)]


def nodes_of(placement, prefix: str) -> list[str]:
    return [node for name, (node, _) in sorted(placement.assigned.items()) if name.startswith(prefix)]


def test_replicas_and_spares_spread_across_nodes():
    placement = place_groups(groups(replicas=2, spares=1, tp=2), {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]})
    assert placement.complete
    trainer_nodes = nodes_of(placement, "replica") + nodes_of(placement, "spare")
    assert sorted(trainer_nodes) == ["a", "b", "c"]  # one trainer group per node


def test_a_replicas_ranks_share_a_node():
    placement = place_groups(groups(replicas=1, tp=2), {"a": [0], "b": [5, 6, 7]})
    assert placement.assigned["replica-0"] == ("b", (5, 6))


def test_engines_spread_and_the_services_avoid_busy_nodes():
    placement = place_groups(groups(replicas=1, engines=2), {"a": [0, 1, 2], "b": [0, 1, 2]})
    assert sorted(nodes_of(placement, "engine")) == ["a", "b"]
    assert placement.assigned["services"][1] == ()
    # The services go where fewest of the job's groups are: the node without the replica.
    replica_node = placement.assigned["replica-0"][0]
    assert placement.assigned["services"][0] != replica_node


def test_ties_break_by_name_and_placement_is_deterministic():
    free = {"b": [0, 1], "a": [0, 1]}
    first = place_groups(groups(replicas=1, engines=1), free)
    assert first == place_groups(groups(replicas=1, engines=1), free)
    assert first.assigned["replica-0"][0] == "a"


def test_what_does_not_fit_is_named():
    placement = place_groups(groups(replicas=2, tp=2), {"a": [0, 1, 2], "b": [0]})
    assert not placement.complete and placement.unplaced == ("replica-1",)
    assert "replica-1 (2 slots on one node)" in placement.reason and "a: 1" in placement.reason


def test_placing_again_spreads_away_from_the_jobs_other_groups():
    existing = {"replica-0": (GroupKind.REPLICA, "a")}
    placement = place_groups([Group("replica-1", GroupKind.REPLICA, 1)], {"a": [1, 2], "b": [0]}, existing)
    assert placement.assigned["replica-1"] == ("b", (0,))


def test_a_failed_or_taken_slot_is_never_given():
    placement = place_groups(groups(engines=2), {"a": [3], "b": []})
    assert placement.assigned.get("engine-0") == ("a", (3,)) and placement.unplaced == ("engine-1",)
