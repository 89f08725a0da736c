"""A node whose lease may have run out keeps its processes; once etcd answers, only the processes whose
work moved on are ended (policies.lease_loss), case by case."""

from __future__ import annotations

import pytest

from policies.lease_loss import Fate, LeaseStanding, NodeAction, fate, may_decide, node_action

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def assignment(node: str = "node-a", generation: int = 3) -> dict:
    return {"node": node, "generation": generation, "devices": [0]}


def test_while_etcd_does_not_answer_the_node_is_fenced_and_kills_nothing():
    assert node_action(LeaseStanding.UNCONFIRMED) is NodeAction.FENCE


def test_etcd_back_within_the_ttl_changes_nothing():
    assert node_action(LeaseStanding.STILL_HELD) is NodeAction.CARRY_ON
    assert node_action(LeaseStanding.FRESH) is NodeAction.CARRY_ON


def test_etcd_back_after_the_ttl_with_nothing_moved_keeps_every_process():
    assert node_action(LeaseStanding.EXPIRED) is NodeAction.REJOIN
    assert fate("node-a", 3, assignment()) is Fate.KEEP


def test_work_moved_elsewhere_meanwhile_ends_the_process_here():
    assert fate("node-a", 3, assignment(node="node-b", generation=4)) is Fate.END


def test_a_partitioned_node_rejoining_ends_what_the_others_replaced_and_keeps_the_rest():
    # While it was cut off, the controller moved one replica (a newer generation on this very node, once
    # the node was back, or elsewhere) and removed an engine; the orchestrator's assignment stayed.
    assert fate("node-a", 3, assignment(generation=5)) is Fate.END
    assert fate("node-a", 3, None) is Fate.END
    assert fate("node-a", 3, assignment()) is Fate.KEEP


def test_after_its_own_fence_the_leader_waits_a_ttl_for_the_others_to_join_again():
    assert may_decide(None, lease_ttl_s=10)  # never fenced: a missing node is gone
    assert not may_decide(3.0, lease_ttl_s=10)  # an outage just ended: the others may be rejoining
    assert may_decide(10.0, lease_ttl_s=10)
