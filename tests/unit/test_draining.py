"""The controller's drain steps for one job (daemon.draining) on a cluster read by hand: what is marked,
what has left, what is taken at the deadline, and what an undrain clears."""

from __future__ import annotations

import time

import pytest

from daemon.cluster import Changes, Cluster, by_group
from daemon.draining import drain_groups, relieved_lighthouse_in_use
from elastic_rl.store import keys

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def assignment(node: str, generation: int = 1, **extra) -> dict:
    return {"node": node, "host": "127.0.0.1", "device": 0, "generation": generation, **extra}


ASSIGNED = {
    "lighthouse": assignment("a", device=None),
    "router": assignment("a", device=None),
    "orchestrator": assignment("a", device=None),
    "trainer-0-0": assignment("b"),
    "trainer-1-0": assignment("a"),
    "engine-0": assignment("a"),
}


def drain(tmp_path, draining: dict, reported: dict | None = None, assigned: dict | None = None):
    status = {"workdir": str(tmp_path), "phase": "running"}
    assigned = assigned or ASSIGNED
    nodes = {"a": {"devices": 4}, "b": {"devices": 4}}
    cluster = Cluster({"j": status}, {"j": assigned}, nodes, {"j": reported or {}}, {}, draining=draining)
    changes = Changes()
    left = drain_groups("j", by_group(assigned), {}, reported or {}, cluster, changes)
    return left, changes


def test_every_group_on_a_draining_node_is_asked_to_leave_once(tmp_path):
    deadline = time.time() + 60
    left, changes = drain(tmp_path, {"a": {"deadline": deadline}})
    assert left == {}
    marked = {key.rsplit("/", 1)[1] for key, value in changes.puts.items() if value["drain"] == deadline}
    assert marked == {"lighthouse", "router", "orchestrator", "trainer-1-0", "engine-0"}
    assert all(value["generation"] == 1 for value in changes.puts.values())  # nothing restarts
    assert [kind for kind, _, _ in changes.events] == ["node_draining"]


def test_a_group_that_left_goes_and_the_node_is_drained_once_all_have(tmp_path):
    deadline = time.time() + 60
    assigned = {name: {**a, "drain": deadline} if a["node"] == "a" else a for name, a in ASSIGNED.items()}
    reported = {"trainer-1-0": {"state": "drained", "generation": 1}, "engine-0": {"state": "running", "generation": 1}}
    left, changes = drain(tmp_path, {"a": {"deadline": deadline}}, reported, assigned)
    assert left == {"replica-1": "node a drained"}
    assert not changes.puts and not changes.services_handed_over
    reported = {
        **reported,
        "engine-0": {"state": "drained", "generation": 1},
        "orchestrator": {"state": "drained", "generation": 1},
    }
    left, changes = drain(tmp_path, {"a": {"deadline": deadline}}, reported, assigned)
    assert set(left) == {"replica-1", "engine-0", "services"} and changes.services_handed_over
    assert [kind for kind, _, _ in changes.events] == ["node_drained"]


def test_a_report_of_an_earlier_generation_has_not_left(tmp_path):
    deadline = time.time() + 60
    reported = {"trainer-1-0": {"state": "drained", "generation": 0}}
    left, _ = drain(tmp_path, {"a": {"deadline": deadline}}, reported)
    assert "replica-1" not in left


def test_what_is_left_at_the_deadline_is_taken(tmp_path):
    left, changes = drain(tmp_path, {"a": {"deadline": time.time() - 1}})
    assert set(left) == {"replica-1", "engine-0", "services"}
    assert sorted(fields["group"] for kind, _, fields in changes.events if kind == "drain_overdue") == sorted(left)
    assert not changes.services_handed_over  # the trainers restart with the services, as after a death


def test_an_undrained_node_loses_its_marks(tmp_path):
    assigned = {**ASSIGNED, "engine-0": {**ASSIGNED["engine-0"], "drain": time.time() + 60}}
    left, changes = drain(tmp_path, {}, assigned=assigned)
    assert left == {} and changes.puts == {keys.assignment("j", "engine-0"): ASSIGNED["engine-0"]}


def test_a_relieved_lighthouse_is_in_use_until_the_named_weights_are_published(tmp_path):
    assert not relieved_lighthouse_in_use(tmp_path, None)
    relieves = {"node": "a", "until": 6}
    (tmp_path / "weights" / "5").mkdir(parents=True)
    assert relieved_lighthouse_in_use(tmp_path, relieves)
    (tmp_path / "weights" / "6").mkdir()
    assert not relieved_lighthouse_in_use(tmp_path, relieves)
