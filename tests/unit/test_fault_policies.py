"""The NaN/Inf guard's policy, and the NaN injection switch."""

from __future__ import annotations

import pytest

from elastic_rl.trainer.nan_injection import ENV_VAR, NanFault, NanInjector, install_from_environment
from policies.nan_guard import Response, StepHealth, decide, needs_recompute_elsewhere

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

TWO = frozenset({0, 1})


def health(nonfinite=(), transient=(), elsewhere=(), reduced_finite=None, participants=TWO) -> StepHealth:
    nonfinite = frozenset(nonfinite)
    finite = not nonfinite if reduced_finite is None else reduced_finite
    return StepHealth(participants, nonfinite, finite, frozenset(transient), frozenset(elsewhere))


def test_a_finite_step_commits():
    assert decide(health(), 0, 3).response is Response.COMMIT


def test_a_shard_finite_on_its_rerun_is_a_transient_skip_never_a_rollback():
    decision = decide(health(nonfinite={1}, transient={1}), consecutive_skips=10, max_consecutive_skips=3)
    assert decision.response is Response.SKIP
    assert "transient" in decision.reason


def test_a_shard_finite_on_another_replica_quarantines_its_device():
    decision = decide(health(nonfinite={1}, elsewhere={1}), 0, 3)
    assert decision.response is Response.QUARANTINE_DEVICE
    assert decision.replicas == {1}


def test_non_finite_everywhere_is_skipped_then_rolled_back():
    everywhere = health(nonfinite={0, 1})
    assert decide(everywhere, 0, 3).response is Response.SKIP
    assert decide(everywhere, 1, 3).response is Response.SKIP
    rollback = decide(everywhere, 2, 3)
    assert rollback.response is Response.ROLLBACK
    assert "3 steps in a row" in rollback.reason


def test_non_finite_only_after_the_reduction_is_skipped():
    decision = decide(health(reduced_finite=False), 0, 3)
    assert decision.response is Response.SKIP
    assert "reduced" in decision.reason


def test_recompute_elsewhere_needs_a_persistent_shard_and_a_healthy_replica():
    assert needs_recompute_elsewhere(health(nonfinite={1}))
    assert not needs_recompute_elsewhere(health(nonfinite={1}, transient={1}))
    assert not needs_recompute_elsewhere(health(nonfinite={0, 1}))
    assert not needs_recompute_elsewhere(health(nonfinite={0}, participants=frozenset({0})))


def test_injection_poisons_only_the_chosen_steps():
    injector = NanInjector(NanFault(frozenset({3}), replica=1, attempts=0))
    assert not injector.poison(2)
    assert injector.poison(3) and injector.poison(3)  # every try: persistent


def test_injection_with_attempts_is_transient():
    injector = NanInjector(NanFault(frozenset({3}), replica=0, attempts=1))
    assert injector.poison(3)
    assert not injector.poison(3)


def test_injection_reaches_only_the_chosen_replica_through_the_environment(monkeypatch):
    installed = []
    monkeypatch.setattr(NanInjector, "install", lambda self, trainer: installed.append(trainer))
    install_from_environment("trainer", replica=0)
    assert installed == []  # the variable unset: nothing installed
    monkeypatch.setenv(ENV_VAR, '{"steps": [3], "replica": 1}')
    install_from_environment("replica-0", replica=0)
    install_from_environment("replica-1", replica=1)
    assert installed == ["replica-1"]
    monkeypatch.setenv(ENV_VAR, '{"steps": [3], "replica": null}')
    install_from_environment("any", replica=0)
    assert installed[-1] == "any"  # bad data: every replica
