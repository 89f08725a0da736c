"""The NaN/Inf guard's responses that outlive a step, acted on by a trainer rank.

``policies.nan_guard`` decides; this records the decision as an event and, where the response
needs a restart, ends the process with the exit code erld acts on: ``EXIT_ROLLBACK`` (the rollout
batch is quarantined and every replica restarts from the newest snapshot) or
``EXIT_DEVICE_QUARANTINED`` (this replica's device is set aside).
"""

from __future__ import annotations

import sys
from pathlib import Path

from checkpoints.rollout_log import quarantine
from elastic_rl.event_kinds import EventKind
from elastic_rl.events import emit_event
from policies.exits import EXIT_DEVICE_QUARANTINED, EXIT_ROLLBACK
from policies.nan_guard import Decision, Response


def respond_to_nan(
    decision: Decision,
    *,
    reports: bool,
    workdir: Path,
    rollout_id: int,
    step: int,
    proc: str,
    replica: int,
    device: str | None,
) -> None:
    """Record the NaN guard's decision on a step; end the process where the response needs a restart.

    ``reports``: this rank emits the events every replica would emit alike (the step's leader's rank 0).
    """
    where = {"device": device, "step": step, "rollout": rollout_id}
    if decision.response is Response.SKIP and reports:
        emit_event(EventKind.NAN_STEP_SKIPPED, f"{decision.reason}; step {step} redone", proc, **where)
    elif decision.response is Response.ROLLBACK:
        quarantine(workdir, rollout_id, step, decision.reason)
        if reports:
            emit_event(
                EventKind.ROLLOUT_QUARANTINED, f"{decision.reason}; rolling back to the newest snapshot", proc, **where
            )
        sys.exit(EXIT_ROLLBACK)
    elif decision.response is Response.QUARANTINE_DEVICE and replica in decision.replicas:
        emit_event(EventKind.DEVICE_QUARANTINED, decision.reason, proc, **where)
        sys.exit(EXIT_DEVICE_QUARANTINED)
