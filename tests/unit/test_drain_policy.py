"""A draining node's groups (policies.drain): each leaves at its safe point, or is taken at the deadline."""

from __future__ import annotations

import pytest

from chaos.scenario import ChaosScenario
from policies.drain import DRAINED_STATE, DrainStep, drain_step, engine_may_stop
from policies.exits import EXIT_DRAINED, ExitAction, ExitFacts, decide_exit
from policies.placement import GroupKind
from policies.restart import RestartPolicy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

DEADLINE = 100.0


def test_a_group_is_asked_to_leave_until_every_process_has_left():
    assert drain_step(GroupKind.REPLICA, ["running", "running"], 50.0, DEADLINE) is DrainStep.ASK
    assert drain_step(GroupKind.REPLICA, [DRAINED_STATE, "running"], 50.0, DEADLINE) is DrainStep.ASK
    assert drain_step(GroupKind.REPLICA, [DRAINED_STATE, DRAINED_STATE], 50.0, DEADLINE) is DrainStep.LEFT
    assert drain_step(GroupKind.ENGINE, [DRAINED_STATE], 50.0, DEADLINE) is DrainStep.LEFT


def test_a_process_not_reported_at_its_assignment_has_not_left():
    assert drain_step(GroupKind.ENGINE, [None], 50.0, DEADLINE) is DrainStep.ASK


def test_what_has_not_left_by_the_deadline_is_taken():
    assert drain_step(GroupKind.REPLICA, [DRAINED_STATE, "running"], DEADLINE, DEADLINE) is DrainStep.OVERDUE
    assert drain_step(GroupKind.SERVICES, ["running"], DEADLINE + 1, DEADLINE) is DrainStep.OVERDUE
    # Left just in time is left.
    assert drain_step(GroupKind.ENGINE, [DRAINED_STATE], DEADLINE + 1, DEADLINE) is DrainStep.LEFT


def test_a_warm_spare_holds_no_work_and_leaves_at_once():
    assert drain_step(GroupKind.SPARE, ["running"], 0.0, DEADLINE) is DrainStep.LEFT


def test_an_engine_stops_once_idle_or_when_the_deadline_nears():
    assert not engine_may_stop(True, 50.0, DEADLINE, 10.0)
    assert engine_may_stop(False, 50.0, DEADLINE, 10.0)
    assert engine_may_stop(None, 50.0, DEADLINE, 10.0)  # does not answer: nothing worth waiting for
    assert engine_may_stop(True, 90.0, DEADLINE, 10.0)  # its requests continue elsewhere in the time left


@pytest.mark.parametrize("role", ["trainer", "orchestrator", "engine", "spare"])
def test_a_process_that_left_its_draining_node_is_not_restarted(role):
    facts = ExitFacts(role=role, exit_code=EXIT_DRAINED, job_finished=False, idle_spare=True, restarts=(), now=100.0)
    assert decide_exit(facts, RestartPolicy(2, 60)).action is ExitAction.DRAINED


def test_a_preemption_needs_erlds_that_drain_on_sigterm():
    scenario = {
        "name": "p",
        "job": "job.yaml",
        "topology": {"nodes": 2},
        "faults": [{"kind": "preempt", "target": "node-1", "at": {"rollout": 1}}],
    }
    with pytest.raises(ValueError, match="preempt needs topology.drain_on_term_s"):
        ChaosScenario.model_validate(scenario)
    ChaosScenario.model_validate({**scenario, "topology": {"nodes": 2, "drain_on_term_s": 30}})
