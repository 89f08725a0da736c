"""What a job process's exit means (policies.exits): one test per row of its table."""

from __future__ import annotations

import pytest

from policies.exits import (
    EXIT_DEVICE_QUARANTINED,
    EXIT_GAVE_UP,
    EXIT_ROLLBACK,
    EXIT_SUPERSEDED,
    EXIT_SYNC_HUNG,
    ExitAction,
    ExitFacts,
    decide_exit,
)
from policies.restart import RestartPolicy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

POLICY = RestartPolicy(max_restarts=2, window_s=60, base_delay_s=0.5, max_delay_s=4)


def decide(role: str, code: int | None, finished=False, idle_spare=False, restarts=(), given_up="", other_engines=0):
    facts = ExitFacts(
        role=role,
        exit_code=code,
        job_finished=finished,
        idle_spare=idle_spare,
        restarts=tuple(restarts),
        now=100.0,
        given_up=given_up,
        other_engines=other_engines,
    )
    return decide_exit(facts, POLICY)


def test_the_orchestrator_ending_after_the_last_rollout_settles_the_job():
    assert decide("orchestrator", 0, finished=True).action is ExitAction.SUCCEED_JOB


def test_the_orchestrator_ending_early_is_a_crash():
    decision = decide("orchestrator", 0, finished=False)
    assert decision.action is ExitAction.RESTART and decision.delay_s == 0.0


@pytest.mark.parametrize("role", ["trainer", "spare"])
def test_a_trainer_done_is_done(role):
    assert decide(role, 0).action is ExitAction.DONE


def test_a_rollback_restarts_at_once_without_the_backoff():
    decision = decide("trainer", EXIT_ROLLBACK, restarts=[99.0])
    assert decision.action is ExitAction.RESTART and decision.rollback and decision.delay_s == 0.0


@pytest.mark.parametrize("role", ["orchestrator", "trainer", "spare"])
def test_a_process_that_gave_up_fails_the_job_with_its_reason(role):
    decision = decide(role, EXIT_GAVE_UP, idle_spare=True, given_up="trainer.dtype bf16 needs a GPU slot")
    assert decision.action is ExitAction.FAIL_JOB
    assert decision.reason == "gave up: trainer.dtype bf16 needs a GPU slot"
    assert decide(role, EXIT_GAVE_UP).reason == "gave up: see its log"


@pytest.mark.parametrize("role", ["orchestrator", "trainer"])
def test_a_superseded_process_is_not_one_that_gave_up(role):
    assert decide(role, EXIT_SUPERSEDED).action is ExitAction.RESTART


def test_a_trainer_that_ended_a_hung_weight_sync_restarts_like_after_a_crash():
    decision = decide("trainer", EXIT_SYNC_HUNG, restarts=[99.0])
    assert decision.action is ExitAction.RESTART and not decision.rollback and decision.delay_s == 0.5


def test_a_quarantined_device_moves_the_replica_and_marks_the_device():
    decision = decide("trainer", EXIT_DEVICE_QUARANTINED)
    assert decision.action is ExitAction.MOVE_REPLICA and decision.quarantine_device


def test_a_crashed_replica_goes_to_an_idle_warm_spare():
    decision = decide("trainer", -9, idle_spare=True)
    assert decision.action is ExitAction.MOVE_REPLICA and not decision.quarantine_device


def test_a_crash_without_a_spare_restarts_at_once_then_after_the_backoff():
    assert decide("trainer", -9).delay_s == 0.0
    assert decide("trainer", -9, restarts=[99.0]).delay_s == 0.5
    assert decide("engine", 1).action is ExitAction.RESTART


def test_a_spent_budget_fails_the_job_with_its_reason():
    decision = decide("router", 1, restarts=[98.0, 99.0])
    assert decision.action is ExitAction.FAIL_JOB and "3 times within 60s" in decision.reason


def test_only_trainers_go_to_spares():
    assert decide("engine", -9, idle_spare=True).action is ExitAction.RESTART


def test_an_engine_whose_budget_is_spent_is_given_up_while_others_run():
    decision = decide("engine", -9, restarts=[98.0, 99.0], other_engines=2)
    assert decision.action is ExitAction.GIVE_UP_ENGINE
    assert "3 times within 60s" in decision.reason and "the job runs on 2 engines" in decision.reason
    assert decide("engine", -9, restarts=[99.0], other_engines=2).action is ExitAction.RESTART  # budget left


def test_the_last_engine_whose_budget_is_spent_fails_the_job():
    assert decide("engine", -9, restarts=[98.0, 99.0], other_engines=0).action is ExitAction.FAIL_JOB


def test_an_adopted_process_asked_to_leave_has_left_though_its_exit_code_is_lost():
    asked = ExitFacts(
        role="trainer",
        exit_code=None,
        job_finished=False,
        idle_spare=False,
        restarts=(),
        now=100.0,
        asked_to_leave=True,
    )
    assert decide_exit(asked, POLICY).action is ExitAction.DRAINED
    # Not asked: an exit with no code is a crash like any other.
    assert decide("trainer", None).action is ExitAction.RESTART
