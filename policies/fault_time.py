"""Time lost to faults, estimated from a job's own record: what erld's /metrics exports for a running job.

A fault leaves an event of one of the ``FAULT_SIGNS`` kinds (a process
exited, an engine turned unhealthy, the quorum shrank, a group moved, ...).
Between two trained rollouts is one interval; one with a fault in it is a
faulted interval, and what it took beyond the job's usual interval (the
median of its intervals without a fault) is time the fault cost. The interval
still open, from the last trained rollout to now, counts once a fault fell in
it, so the figure rises through an outage, not only once training resumes.
Faults before the first trained rollout are not counted: that interval holds
the job's start-up, with nothing usual to measure it against.

The chaos harness measures the same against a fault-free reference run
(``chaos.report``); this estimate needs none, so a live job can export it.
"""

from __future__ import annotations

from statistics import median

FAULT_SIGNS = (
    "proc_exited",
    "engine_unhealthy",
    "quorum_changed",
    "nan_step_skipped",
    "device_quarantined",
    "snapshot_skipped",
    "spare_promoted",
    "replica_moved",
    "engine_moved",
    "services_moved",
    "spare_moved",
    "job_adopted",
    "trainer_rollback",
    "snapshot_failed",
    "replica_straggling",
)
"""The event kinds that say a fault happened (or was seen to)."""


def time_lost_to_faults(trained: list[float], faults: list[float], now: float) -> float:
    """Seconds the job's faults cost, from the times its rollouts were trained and the times of its
    fault events; 0 until one interval without a fault gives the usual one."""
    times = sorted(trained)
    intervals = [*zip(times, times[1:]), *([(times[-1], now)] if times else [])]
    faulted = [any(start < fault <= end for fault in faults) for start, end in intervals]
    clean = [end - start for (start, end), hit in zip(intervals[:-1], faulted[:-1]) if not hit]
    if not clean:
        return 0.0
    usual = median(clean)
    return sum(max(0.0, end - start - usual) for (start, end), hit in zip(intervals, faulted) if hit)
