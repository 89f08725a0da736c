"""The straggler rule, branch by branch (``policies.straggler``), and what erld and `erl status` make of a straggler."""

from __future__ import annotations

import pytest

from elastic_rl.cli.jobs_read import _format_status
from policies.exits import EXIT_STRAGGLED, ExitAction, ExitFacts, decide_exit
from policies.restart import RestartPolicy
from policies.straggler import (
    MIN_EXCESS_S,
    StragglerAction,
    StragglerRule,
    due,
    judge,
    peer_ratios,
    response,
)

pytestmark = pytest.mark.timeout(10)

RULE = StragglerRule(factor=2.0, steps=3)


def run_steps(steps: list[dict[int, float]], rule: StragglerRule = RULE):
    streaks: dict[int, int] = {}
    verdict = None
    for times in steps:
        verdict = judge(times, streaks, rule)
        streaks = verdict.streaks
    return verdict


def test_one_replica_slow_for_the_rules_steps_is_a_straggler():
    verdict = run_steps([{0: 1.0, 1: 4.0, 2: 1.1}] * 3)
    assert verdict.stragglers == {1} and verdict.streaks == {1: 3}
    assert verdict.ratios[1] == pytest.approx(4.0 / 1.05) and verdict.ratio == verdict.ratios[1]


def test_every_replica_slow_is_no_straggler():
    """The overload rule: a step twice as long everywhere is nobody's fault."""
    verdict = run_steps([{0: 1.0, 1: 1.0}] * 2 + [{0: 4.0, 1: 4.1}] * 5)
    assert verdict.stragglers == frozenset() and verdict.streaks == {}


def test_slow_for_fewer_steps_than_the_rule_needs_is_no_straggler():
    verdict = run_steps([{0: 1.0, 1: 4.0}] * 2)
    assert verdict.stragglers == frozenset() and verdict.streaks == {1: 2}


def test_a_step_at_its_peers_pace_ends_the_run_of_slow_steps():
    verdict = run_steps([{0: 1.0, 1: 4.0}] * 2 + [{0: 1.0, 1: 1.2}] + [{0: 1.0, 1: 4.0}] * 2)
    assert verdict.stragglers == frozenset() and verdict.streaks == {1: 2}


def test_a_step_it_took_no_part_in_ends_its_run_too():
    verdict = run_steps([{0: 1.0, 1: 4.0}] * 2 + [{0: 1.0, 2: 1.0}] + [{0: 1.0, 1: 4.0}])
    assert verdict.streaks == {1: 1}


def test_with_two_replicas_the_slow_one_is_compared_with_the_other_and_not_the_reverse():
    assert peer_ratios({0: 1.0, 1: 4.0}) == {0: 1.0, 1: 4.0}


def test_a_single_replica_has_nobody_to_compare_with():
    verdict = run_steps([{0: 9.0}] * 5)
    assert verdict.ratios == {} and verdict.ratio == 1.0 and verdict.stragglers == frozenset()


def test_a_tiny_difference_is_noise_whatever_its_ratio():
    assert peer_ratios({0: 0.010, 1: 0.010 + MIN_EXCESS_S / 2}) == {0: 1.0, 1: 1.0}


def test_a_straggler_acts_when_its_run_reaches_the_rule_then_every_rules_steps():
    assert [streak for streak in range(1, 11) if due(streak, RULE)] == [3, 6, 9]


def test_a_straggler_leaves_only_with_somewhere_to_go():
    assert response(replaceable=True) is StragglerAction.LEAVE
    assert response(replaceable=False) is StragglerAction.REPORT


def test_erld_marks_a_stragglers_devices_failed_and_moves_its_replica():
    facts = ExitFacts(role="trainer", exit_code=EXIT_STRAGGLED, job_finished=False, idle_spare=True, restarts=(), now=0)
    decision = decide_exit(facts, RestartPolicy(max_restarts=5, window_s=600))
    assert decision.action is ExitAction.MOVE_REPLICA and decision.quarantine_device


def test_erl_status_says_how_many_stragglers_were_replaced():
    info = {
        "job": "tiny",
        "status": {"phase": "running", "workdir": "/runs/tiny"},
        "progress": {},
        "num_rollouts": 10,
        "procs": {},
        "events": [],
        "stragglers": [
            {"kind": "replica_straggling", "proc": "trainer-1-0", "step": 5, "replaced": False, "message": "kept"},
            {"kind": "replica_straggling", "proc": "trainer-1-0", "step": 9, "replaced": True, "message": "left"},
        ],
    }
    line = next(line for line in _format_status(info).splitlines() if "stragglers" in line)
    assert "1 replaced, 1 kept" in line and "trainer-1-0 at step 9" in line
