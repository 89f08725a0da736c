"""What a job process's exit means, and what erld does about it.

Pure: the facts of one exit in, an action out. The rows:

| who | exit | action |
|---|---|---|
| orchestrator | any, with every rollout trained | the job succeeded |
| orchestrator, trainer or spare | gave up (77) | fail the job, with the reason it reported |
| trainer or spare | 0 | done: nothing to do (the orchestrator settles the job) |
| any | drained (73) | it left its draining node at a safe point: not restarted (the controller places it elsewhere) |
| any | unknown (adopted from an earlier erld), its assignment asked it to leave | as drained |
| trainer | rollback (75) | restart at once, from the newest snapshot |
| trainer | device quarantined (76) | mark the device failed; the replica moves (a warm spare, or free devices) |
| trainer | straggled (79) | as device quarantined: its devices marked failed, the replica moves |
| trainer | other, an idle warm spare exists | the spare takes the replica's place |
| engine (or teacher) | other, its budget spent, another of its kind running | give it up: run on the others |
| any | other | restart after the restart policy's backoff, or fail the job once its budget is spent |

An engine found hung by its health check counts as an exit here, so its
replacements go through the same backoff and budget.

The agent that saw the exit applies the action; moving a replica is the
controller's (it may go to another node).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from policies.restart import RestartPolicy, decide_restart

EXIT_ROLLBACK = 75
"""The trainers rolled back: restart at once, from the newest snapshot."""
EXIT_DEVICE_QUARANTINED = 76
"""This replica's device produced non-finite values: mark it failed, move the replica."""
EXIT_GAVE_UP = 77
"""Restarting cannot help: the orchestrator's failure budget ran out (e.g. too much unscorable data),
or a trainer cannot run where it was placed (a GPU slot and a torch without CUDA, say)."""
EXIT_SUPERSEDED = 78
"""A process found its assignment taken by a newer instance (``elastic_rl.fencing``): a crash like any
other here, and a number of its own, so that it is never taken for a give-up."""
EXIT_STRAGGLED = 79
"""This replica was slower than its peers for ``fault_tolerance.straggler_steps`` steps in a row
(``policies.straggler``) and left: mark its devices failed, move the replica."""
EXIT_DRAINED = 73
"""The process left its draining node at its safe point (``policies.drain``): a trainer replica after its
rollout's last step, the orchestrator after a commit. Not a crash: nothing restarts it here."""
EXIT_SYNC_HUNG = 74
"""A trainer's weight sync hung past its abort, and the trainer ended itself: a crash like any other
(the last row), named so that no other code takes its number."""
EXIT_HANDOVER_HUNG = 72
"""Colocated: a trainer rank could not load its state onto its device, or offload it, within
fault_tolerance.handover_timeout_s, and ended itself: a crash like any other (the last row)."""


class ExitAction(Enum):
    SUCCEED_JOB = "succeed_job"
    DONE = "done"
    DRAINED = "drained"
    RESTART = "restart"
    MOVE_REPLICA = "move_replica"
    GIVE_UP_ENGINE = "give_up_engine"
    FAIL_JOB = "fail_job"


@dataclass(frozen=True, kw_only=True)
class ExitFacts:
    role: str
    """orchestrator, trainer, spare, engine, teacher (a distillation teacher's engine), router or lighthouse."""
    exit_code: int | None
    job_finished: bool
    """The orchestrator reported every rollout trained."""
    idle_spare: bool
    """A warm spare of the job is running and unassigned."""
    restarts: tuple[float, ...]
    """Times of this process's earlier restarts."""
    now: float
    given_up: str = ""
    """Why the orchestrator gave up, as it reported it."""
    other_engines: int = 0
    """An engine's exit: the job's other engines of its kind (the policy's, or the teacher's) still running."""
    asked_to_leave: bool = False
    """Its assignment asks it to leave its draining node at a safe point."""


@dataclass(frozen=True)
class ExitDecision:
    action: ExitAction
    delay_s: float = 0.0
    reason: str = ""
    rollback: bool = False
    """A restart the NaN guard asked for: no backoff, from the newest snapshot."""
    quarantine_device: bool = False
    """The process's device is to be marked failed."""


def decide_exit(facts: ExitFacts, policy: RestartPolicy) -> ExitDecision:
    if facts.role == "orchestrator" and facts.job_finished:
        return ExitDecision(ExitAction.SUCCEED_JOB, reason="every rollout trained")
    if facts.role in ("orchestrator", "trainer", "spare") and facts.exit_code == EXIT_GAVE_UP:
        return ExitDecision(ExitAction.FAIL_JOB, reason=f"gave up: {facts.given_up or 'see its log'}")
    if facts.exit_code == EXIT_DRAINED:
        return ExitDecision(ExitAction.DRAINED, reason="left its draining node")
    if facts.exit_code is None and facts.asked_to_leave:
        # A process an erld adopted is not its child: its exit code is lost. Asked to leave, it left.
        return ExitDecision(ExitAction.DRAINED, reason="left its draining node (exit code unknown: adopted)")
    if facts.role in ("trainer", "spare") and facts.exit_code == 0:
        return ExitDecision(ExitAction.DONE)
    if facts.role == "trainer" and facts.exit_code == EXIT_ROLLBACK:
        return ExitDecision(ExitAction.RESTART, rollback=True, reason="restarting from the newest snapshot")
    if facts.role == "trainer" and facts.exit_code == EXIT_DEVICE_QUARANTINED:
        return ExitDecision(
            ExitAction.MOVE_REPLICA, quarantine_device=True, reason="its device produced non-finite values"
        )
    if facts.role == "trainer" and facts.exit_code == EXIT_STRAGGLED:
        return ExitDecision(ExitAction.MOVE_REPLICA, quarantine_device=True, reason="it straggled behind its peers")
    if facts.role == "trainer" and facts.idle_spare:
        return ExitDecision(ExitAction.MOVE_REPLICA, reason="a warm spare takes its place")
    restart = decide_restart(policy, list(facts.restarts), facts.now)
    if not restart.restart and facts.role in ("engine", "teacher") and facts.other_engines:
        left = f"{facts.other_engines} engine{'s' if facts.other_engines != 1 else ''}"
        return ExitDecision(ExitAction.GIVE_UP_ENGINE, reason=f"{restart.reason}; the job runs on {left}")
    if not restart.restart:
        return ExitDecision(ExitAction.FAIL_JOB, reason=restart.reason)
    return ExitDecision(ExitAction.RESTART, delay_s=restart.delay_s)
