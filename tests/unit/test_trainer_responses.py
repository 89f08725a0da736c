"""What a trainer rank does outside its steps: a warm spare takes the place erld gives it, and the
NaN guard's responses that outlive a step end the process with the exit code erld acts on."""

from __future__ import annotations

import pytest

from checkpoints import layout
from elastic_rl.trainer import nan_response
from elastic_rl.trainer.nan_response import respond_to_nan
from elastic_rl.trainer.warm_spare import Place, wait_for_place
from policies.exits import EXIT_DEVICE_QUARANTINED, EXIT_ROLLBACK
from policies.nan_guard import Decision, Response

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_warm_spare_takes_the_place_erld_writes_or_none_once_stopped(tmp_path):
    assert wait_for_place(tmp_path, "spare-0-1", stopped=lambda: True) is None
    path = layout.spare_assignment_path(tmp_path, "spare-0-1")
    path.parent.mkdir(parents=True)
    path.write_text('{"replica": 2, "generation": 7}')
    assert wait_for_place(tmp_path, "spare-0-1", stopped=lambda: False) == Place(replica=2, generation=7)


@pytest.fixture
def recorded_events(monkeypatch) -> list[str]:
    """emit_event, which needs the job's etcd, replaced by a recorder of the events' kinds."""
    kinds: list[str] = []
    monkeypatch.setattr(nan_response, "emit_event", lambda kind, message, proc, **fields: kinds.append(kind))
    return kinds


def respond(decision: Decision, workdir, reports: bool = True, replica: int = 0) -> None:
    respond_to_nan(
        decision,
        reports=reports,
        workdir=workdir,
        rollout_id=4,
        step=9,
        proc=f"trainer-{replica}-0",
        replica=replica,
        device="cpu:0",
    )


def test_a_skipped_step_is_reported_once_and_the_process_goes_on(tmp_path, recorded_events):
    respond(Decision(Response.SKIP, reason="non-finite"), tmp_path)
    respond(Decision(Response.SKIP, reason="non-finite"), tmp_path, reports=False)
    respond(Decision(Response.COMMIT), tmp_path)
    assert recorded_events == ["nan_step_skipped"]


def test_a_rollback_quarantines_the_rollout_and_exits_for_a_restart(tmp_path, recorded_events):
    with pytest.raises(SystemExit) as exited:
        respond(Decision(Response.ROLLBACK, reason="3 skips in a row"), tmp_path, reports=False)
    assert exited.value.code == EXIT_ROLLBACK
    assert layout.quarantined_rollouts(tmp_path) == {4} and recorded_events == []


def test_only_the_replica_at_fault_leaves_its_device(tmp_path, recorded_events):
    decision = Decision(Response.QUARANTINE_DEVICE, replicas=frozenset({1}), reason="replica 1 alone non-finite")
    respond(decision, tmp_path, replica=0)
    with pytest.raises(SystemExit) as exited:
        respond(decision, tmp_path, replica=1)
    assert exited.value.code == EXIT_DEVICE_QUARANTINED and recorded_events == ["device_quarantined"]
