"""Every kind of event a job records (``elastic_rl.events``), with what it means.

An event's kind is stored as its string, in etcd and in ``events.jsonl``, so
a member's value never changes: readers (`erl status`, the chaos harness,
``policies.fault_time``) and a cluster mid-upgrade rely on it. The docs'
events reference is generated from this enum, and ``EventLog.emit`` refuses
a kind that is not in it.
"""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    meaning: str

    def __new__(cls, value: str, meaning: str) -> EventKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    # The job as a whole (the controller and the agents).
    JOB_STARTED = "job_started", "The controller placed the job's processes for the first time."
    JOB_ADOPTED = "job_adopted", "An erld that started found the job's processes running and adopted them."
    JOB_SUCCEEDED = "job_succeeded", "Every rollout was trained."
    JOB_FAILED = "job_failed", "The job failed: a budget ran out, a process gave up, or its spec cannot run."
    JOB_STOPPED = "job_stopped", "`erl stop` stopped the job."
    JOB_PAUSED = "job_paused", "The job lacked room for its minimum for longer than its grace: its processes stop."
    JOB_RESUMED = "job_resumed", "A paused job has room again and resumes from its newest snapshot."
    ERLD_STOPPED = "erld_stopped", "`erl shutdown` stopped erld and the processes it ran; the job resumes with it."
    # Processes.
    PROC_STARTED = "proc_started", "A process started (from a pre-imported interpreter or cold)."
    PROC_EXITED = "proc_exited", "A process exited; its exit code and log are in the message."
    PROC_RESTARTED = "proc_restarted", "A process was restarted after an exit or a hang."
    # Placement (the controller): a group is a trainer replica, a spare, an engine or the services.
    REPLICA_ADDED = "replica_added", "A trainer replica was added (an elastic job grew, or `erl scale`)."
    SPARE_ADDED = "spare_added", "A warm spare was placed."
    ENGINE_ADDED = "engine_added", "An engine was added."
    SERVICES_ADDED = "services_added", "The services (orchestrator, router, lighthouse) were placed."
    REPLICA_MOVED = "replica_moved", "A replica lost its node or device and was placed elsewhere."
    SPARE_MOVED = "spare_moved", "A spare lost its node or device and was placed elsewhere."
    ENGINE_MOVED = "engine_moved", "An engine lost its node or device and was placed elsewhere."
    SERVICES_MOVED = "services_moved", "The services lost their node and were placed elsewhere."
    REPLICA_DEGRADED = "replica_degraded", "A replica waits for room; the job runs on without it."
    SPARE_DEGRADED = "spare_degraded", "A spare waits for room."
    ENGINE_DEGRADED = "engine_degraded", "An engine waits for room; the job runs on the others."
    SERVICES_DEGRADED = "services_degraded", "The services wait for room."
    REPLICA_REMOVED = "replica_removed", "A replica beyond the minimum left: scaled away, or its node lost."
    ENGINE_REMOVED = "engine_removed", "An engine beyond the minimum lost its node with no room elsewhere and left."
    ENGINES_SCALED = "engines_scaled", "The number of engines placed changed."
    SPARE_PROMOTED = "spare_promoted", "A warm spare took the place of a failed replica."
    NODE_DRAINING = "node_draining", "A node was asked to drain: the job's processes leave it at safe points."
    NODE_DRAINED = "node_drained", "The job has left a draining node."
    DRAIN_OVERDUE = (
        "drain_overdue",
        "A process had not left its draining node by the deadline: moved as after a node death.",
    )
    # Trainers.
    TRAINER_READY = "trainer_ready", "A trainer rank imported and set up; it asks for a quorum next."
    TRAINER_RESUMED = "trainer_resumed", "A trainer resumed from a snapshot; the rollouts it trains again are named."
    TRAINER_CAUGHT_UP = "trainer_caught_up", "A resumed trainer replayed the committed rollouts it had missed."
    TRAINER_ROLLBACK = "trainer_rollback", "The trainers roll back to the newest snapshot (a quarantined rollout)."
    TRAINER_GAVE_UP = "trainer_gave_up", "A trainer cannot run where it was placed; the job fails with the reason."
    QUORUM_CHANGED = "quorum_changed", "The number of replicas in the torchft quorum changed."
    REPLICA_HEALED = "replica_healed", "A replica that joined took a peer's state instead of a snapshot."
    REPLICA_LEFT = "replica_left", "A replica left the quorum at a safe point because its node drains."
    LIGHTHOUSE_FOLLOWED = "lighthouse_followed", "The trainers follow a lighthouse at a new address."
    NAN_STEP_SKIPPED = "nan_step_skipped", "A step with non-finite values was not committed and is redone."
    ROLLOUT_QUARANTINED = (
        "rollout_quarantined",
        "A rollout is non-finite on every replica: it is skipped after rollback.",
    )
    DEVICE_QUARANTINED = "device_quarantined", "A device kept producing non-finite values: it is marked failed."
    ENGINE_STRAGGLING = (
        "engine_straggling",
        "An engine generated well below its peers' pace: new requests go to each engine in proportion to its "
        "pace until it catches up (it is never restarted for being slow).",
    )
    REPLICA_STRAGGLING = (
        "replica_straggling",
        "A trainer replica was slower than its peers for several steps in a row: it leaves for a replacement, "
        "its devices marked failed (or, with nowhere to go, it trains on).",
    )
    SNAPSHOT_FAILED = "snapshot_failed", "A snapshot could not be saved (a full disk, say); the next one tries again."
    SNAPSHOT_SKIPPED = "snapshot_skipped", "A snapshot failed its check on resume; an older one is used."
    WEIGHT_BROADCAST_FAILED = "weight_broadcast_failed", "Broadcasting weights failed; the engines load them from disk."
    HANDOVER_TIMEOUT = "handover_timeout", "Colocated: an engine did not release or resume its memory in time."
    # Engines.
    ENGINE_SERVING = "engine_serving", "An engine serves: the policy's in the router, a teacher's answering."
    ENGINE_UNHEALTHY = "engine_unhealthy", "An engine failed its health check (a hang or an exit) and is replaced."
    ENGINE_GIVEN_UP = "engine_given_up", "An engine's restart budget ran out; the job runs on the other engines."
    ENGINE_DRAINING = "engine_draining", "An engine left the router and finishes its requests (its node drains)."
    # The orchestrator and the data.
    ORCHESTRATOR_GAVE_UP = "orchestrator_gave_up", "A failure budget of the orchestrator ran out; the job fails."
    ORCHESTRATOR_LEFT = "orchestrator_left", "The orchestrator left after a commit because its node drains."
    PROMPTS_SKIPPED = "prompts_skipped", "Prompts too long for the rollout were skipped."
    SAMPLES_SKIPPED = "samples_skipped", "Samples that could not be scored were skipped with their groups."
    ROLLOUT_FUNCTION_FAILED = "rollout_function_failed", "The custom rollout function raised and was called again."
    ABORT_FAILED = "abort_failed", "Aborting requests still out failed; they generate to their end."
    STALE_GROUPS_DROPPED = "stale_groups_dropped", "Buffered groups past rollout.max_staleness were dropped."
    STALE_PREFIXES_DROPPED = "stale_prefixes_dropped", "In-flight samples past rollout.max_staleness were started over."
    INFLIGHT_PERSIST_FAILED = "inflight_persist_failed", "Writing the in-flight log failed; generation goes on."
    INFLIGHT_PERSIST_RESUMED = "inflight_persist_resumed", "Writing the in-flight log works again."
    # Invariants checked by the job itself.
    WEIGHT_VERSION_MISMATCH = (
        "weight_version_mismatch",
        "Samples hold tokens of a weight version their rollout does not allow.",
    )
    LOGPROB_GAP_EXCEEDED = (
        "logprob_gap_exceeded",
        "Deterministic mode: trainer and engine log probs differ past the bound.",
    )
